// Package pricing is what a request costs: a model's prices (Prices, micro-units per 1,000,000
// tokens, with their defaults), a request's token counts (Usage), the cost and the bound of a
// request with no float and no overflow, and price tables (LiteLLM's JSON, escrow's CSV, decimal
// prices read digit by digit) for importing models.
package pricing
