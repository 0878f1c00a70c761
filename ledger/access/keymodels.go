package access

import (
	"context"
	"fmt"
	"strings"

	"github.com/llmescrow/escrow/ledger"
)

// Keys limited to models (issue 36, DESIGN.md "Two planes"): a key may carry an allow-list of
// models; a request for any other model is answered as if the model did not exist.

// OrgFlags is the role interface of a ledger whose orgs may be exempt (both ledgers implement
// it): an exempt org's requests (the platform's own users) are authenticated, limited by its
// limits, metered and charged to its ledger, a negative balance allowed, but never held and never
// refused for balance. ledger.OrgInfo.Exempt and ledger.APIKey.Exempt carry the flag.
type OrgFlags interface {
	// SetOrgExempt sets or clears an org's exempt flag (ledger.ErrUnknownOrg).
	SetOrgExempt(ctx context.Context, org string, exempt bool) error
}

// maxKeyModels bounds a key's allow-list.
const maxKeyModels = 256

// KeyModels is the role interface of a ledger whose keys may be limited to models (both ledgers
// implement it). ledger.APIKey.Models and ledger.KeyInfo.Models carry the list.
type KeyModels interface {
	// SetKeyModels sets a key's allow-list (ledger.ErrUnknownKey); nil or empty lets it use every model.
	SetKeyModels(ctx context.Context, keyID string, models []string) error
}

// CheckKeyModels validates an allow-list: at most maxKeyModels entries, each a model name of 1 to
// 200 bytes without spaces, or such a prefix followed by '*' (alone, "*" is every model).
func CheckKeyModels(models []string) error {
	if len(models) > maxKeyModels {
		return fmt.Errorf("%w: at most %d models per key", ledger.ErrInvalidQuery, maxKeyModels)
	}
	for _, m := range models {
		name := strings.TrimSuffix(m, "*")
		if len(m) == 0 || len(m) > 200 || strings.ContainsAny(m, " \t\r\n") || strings.Contains(name, "*") {
			return fmt.Errorf("%w: model %q: a name or a prefix ending in '*', without spaces", ledger.ErrInvalidQuery, m)
		}
	}
	return nil
}

// ModelAllowed reports whether a key with allow-list models may use model: every model when the
// list is empty, else an exact name or a prefix entry ("gpt-4o*") that model starts with.
func ModelAllowed(models []string, model string) bool {
	if len(models) == 0 {
		return true
	}
	for _, m := range models {
		if p, ok := strings.CutSuffix(m, "*"); ok {
			if strings.HasPrefix(model, p) {
				return true
			}
		} else if m == model {
			return true
		}
	}
	return false
}
