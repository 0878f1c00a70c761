package middleware

import (
	"net/http"

	"github.com/llmescrow/escrow/ledger/access"
)

// keyModelRefusal refuses a model the key is not allowed (Identity.Models) with the very answer
// of a model that does not exist (priceModel's), so the key learns nothing of the others.
func keyModelRefusal(id Identity, model string) *Error {
	if access.ModelAllowed(id.Models, model) {
		return nil
	}
	return errModelNotFound(model)
}

func errModelNotFound(model string) *Error {
	return &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Param: "model", Code: CodeModelNotFound,
		Message: "The model '" + model + "' does not exist or you do not have access to it."}
}
