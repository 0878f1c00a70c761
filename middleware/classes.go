package middleware

import (
	"net/http"
	"slices"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// classFeatures are the request features price classes price: a request using one passes
// without Config.Allow when its model has a price for each class (pricedFeatures), and is
// refused otherwise — "a feature the price table cannot price is refused unless a price for it
// is configured".
var classFeatures = map[string][]pricing.Class{
	"audio": pricing.AudioClasses, // chat: input_audio parts, the audio output parameter
}

// billable is the set of price classes a request can bill: the hold's bound prices its input at
// the highest input class among them (pricing.Prices.MaxInputFor) and its output at the highest
// output class: its endpoint's classes (endpoint.Spec.Classes: only Anthropic's usage carries
// cache writes, so no other request's input is bounded at their prices), plus the audio
// classes for a request with audio.
func billable(r Request) []pricing.Class {
	if slices.Contains(r.Features, "audio") {
		return slices.Concat(r.Spec.Classes, pricing.AudioClasses)
	}
	return r.Spec.Classes
}

// pricedFeatures refuses a request using a feature that price classes price (classFeatures)
// when the model lacks a price for one of them and Config.Allow does not name the feature.
func (m *middleware) pricedFeatures(model ledger.Model, r Request) *Error {
	for _, f := range r.Features {
		classes := classFeatures[f]
		if classes == nil || m.allow[f] {
			continue
		}
		for _, c := range classes {
			if !model.Has(c) {
				return errFeature(f)
			}
		}
	}
	return nil
}

// errFeature is the answer to a request using a feature its model's prices cannot price.
func errFeature(f string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: featureParam(f), Code: CodeUnsupported,
		Message: "This request uses a feature that cannot be priced here: " + f + "."}
}
