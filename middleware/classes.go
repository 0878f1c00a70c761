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

// audioTextClasses are what a chat request with audio can bill.
var audioTextClasses = slices.Concat(pricing.TextClasses, pricing.AudioClasses)

// billable is the set of price classes a request can bill: the hold's bound prices its input at
// the highest input class among them (pricing.Prices.MaxInputFor) and its output at the highest
// output class. Only Anthropic's usage carries cache writes (the 1-hour one defaults to 2× the
// input price), so no other request's input is bounded at their prices.
func billable(r Request) []pricing.Class {
	switch {
	case r.Endpoint == EndpointMessages:
		return pricing.CacheClasses
	case slices.Contains(r.Features, "audio"):
		return audioTextClasses
	}
	return pricing.TextClasses
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
