package admin

import "github.com/llmescrow/escrow/ledger"

// The answers of the routes that are not an accounting type as it is, named so that the handler
// and a client (the escrow CLI) share one definition of their JSON.

// Page is one page of a list: {"data":[…],"next":"cursor"|null}. Next is null on the last page;
// a list that is never paged (usage, top spenders, models, limits) is one page.
type Page[T any] struct {
	Data []T     `json:"data"`
	Next *string `json:"next"`
}

// Named is an org or a key by its id and name: the answer to POST /orgs and PATCH /keys/:id.
type Named struct {
	ID   string `json:"id"`
	Name string `json:"name"`
}

// NewKey is the answer to POST /orgs/:org/keys: the key created, with its secret (shown this
// once, never again).
type NewKey struct {
	ID   string `json:"id"`
	Key  string `json:"key"`
	Name string `json:"name"`
	Org  string `json:"org"`
}

// Epoch is the ledger's epoch: the answer to GET and POST /ledger/epoch.
type Epoch struct {
	Generation int64  `json:"generation"`
	ID         string `json:"id"`
}

// Spender is a row of GET /usage/top: a usage row named by its org. The outer Group, always
// empty and so omitted, hides the row's own "group" from the JSON.
type Spender struct {
	Org   string `json:"org"`
	Group string `json:"group,omitempty"`
	ledger.UsageRow
}

// NewWebhook is the answer to POST /webhooks: the endpoint created, with its signing secret
// (shown this once, never again).
type NewWebhook struct {
	ledger.Webhook
	Secret string `json:"secret"`
}

// Limit is a limit as POST /orgs/:org/limits and PATCH /orgs/:org/limits/:id answer it (the
// list answers ledger.LimitView, with its window's state).
type Limit struct {
	ID      string `json:"id"`
	Scope   string `json:"scope"`
	ScopeID string `json:"scope_id,omitempty"`
	Window  string `json:"window"`
	Unit    string `json:"unit,omitempty"` // requests or tokens; absent for money
	Cap     int64  `json:"cap"`
	// RequireEndUser: the org's requests naming no end user are refused (a limit of each end
	// user apart only).
	RequireEndUser bool `json:"require_end_user,omitempty"`
}
