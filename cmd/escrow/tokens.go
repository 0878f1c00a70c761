package main

import (
	"net/http"
	"net/url"
	"strings"

	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/ledger/access"
)

var tokenTable = table[access.Token]{
	{"id", func(t access.Token) string { return t.ID }},
	{"name", func(t access.Token) string { return t.Name }},
	{"scope", func(t access.Token) string { return t.Scope }},
	{"created_at", func(t access.Token) string { return ts(t.CreatedAt) }},
	{"expires_at", func(t access.Token) string { return optTS(t.ExpiresAt) }},
	{"revoked_at", func(t access.Token) string { return optTS(t.RevokedAt) }},
	{"rotated_to", func(t access.Token) string { return t.RotatedTo }},
}

var newTokenTable = append(via(tokenTable.only("id", "name", "scope", "created_at"), func(t admin.Token) access.Token { return t.Info() }),
	column[admin.Token]{"token", func(t admin.Token) string { return t.Token }})

// cmdTokens: escrow tokens | create --scope S [--name N] | rotate ID [--overlap D] | revoke ID.
func cmdTokens(args []string) error {
	fs, o := newFlags("tokens")
	name := fs.String("name", "", "display name (create)")
	scope := fs.String("scope", "", "read (every GET), admin, or org:ORG (that org's keys, limits, usage and credits) (create)")
	overlap := fs.Duration("overlap", 0, "how long the old token stays valid beside the new one (rotate; default the server's, 24h)")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) == 0:
		return list(c, o, "/tokens", nil, tokenTable)
	case len(pos) == 1 && pos[0] == "create" && *scope != "":
		return show(c, o, http.MethodPost, "/tokens", map[string]string{"name": *name, "scope": *scope}, newTokenTable)
	case len(pos) == 2 && pos[0] == "rotate":
		body := map[string]any{}
		if *overlap > 0 {
			body["overlap_seconds"] = int64(overlap.Seconds())
		}
		return show(c, o, http.MethodPost, "/tokens/"+url.PathEscape(pos[1])+"/rotate", body, newTokenTable)
	case len(pos) == 2 && pos[0] == "revoke":
		return c.do(http.MethodDelete, "/tokens/"+url.PathEscape(pos[1]), nil, "revoked "+pos[1])
	default:
		return usageErr("usage: escrow tokens | create --scope read|admin|org:ORG [--name NAME] | rotate ID [--overlap 24h] | revoke ID  [--json|--csv]")
	}
}

var keyModelsTable = table[admin.KeyModels]{
	{"id", func(k admin.KeyModels) string { return k.ID }},
	{"models", func(k admin.KeyModels) string { return strings.Join(k.Models, ",") }},
}

// keyModels: escrow keys models KEY_ID [MODEL,PREFIX*,…] — limits a key to models (none given:
// every model again).
func keyModels(c *client, o *output, args []string) error {
	models := []string{}
	if len(args) == 2 && args[1] != "" {
		models = strings.Split(args[1], ",")
	}
	return show(c, o, http.MethodPut, "/keys/"+url.PathEscape(args[0])+"/models", map[string]any{"models": models}, keyModelsTable)
}
