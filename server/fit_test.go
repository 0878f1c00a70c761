package server

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// TestFitThroughTheProxy (issue 23): README's "What a request holds" example through the proxy.
// A model at 2 / 8 per token with 32,768 output tokens, a customer with 200,000 (0.20): "hi"
// without max_tokens has a bound of ≈ 262,300 and is served fitted, the header passes the proxy,
// the upstream's cost stays within the fitted hold and the ledger never goes below 0. Asked for
// the refusal (x-escrow-fit: off), the customer gets the numbers. A key's daily limit fits the
// same way, to the limit's room.
func TestFitThroughTheProxy(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			p := startTestProxy(t, real)
			p.admin("PUT", "/models/big", map[string]any{"input_price": 2_000_000, "output_price": 8_000_000,
				"max_input_tokens": 128_000, "max_output_tokens": 32_768}, http.StatusOK, nil)
			p.admin("POST", "/orgs", map[string]string{"id": "small"}, http.StatusCreated, nil)
			p.admin("POST", "/orgs/small/credits", map[string]any{"amount": 200_000, "reference": "init-small"}, http.StatusCreated, nil)
			var k struct{ ID, Key string }
			p.admin("POST", "/orgs/small/keys", nil, http.StatusCreated, &k)
			body := `{"model":"big","messages":[{"role":"user","content":"hi"}]}`

			// Fit off: the refusal, with the numbers.
			req, _ := http.NewRequest("POST", p.base+"/v1/chat/completions", strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+k.Key)
			req.Header.Set("X-Escrow-Fit", "off")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var refusal struct {
				Error struct{ Message, Code string }
			}
			_ = json.NewDecoder(resp.Body).Decode(&refusal)
			resp.Body.Close()
			bound := int64(len(body))*2 + 32_768*8
			fits := (200_000 - int64(len(body))*2) / 8
			if resp.StatusCode != 429 || refusal.Error.Code != "insufficient_quota" ||
				!strings.Contains(refusal.Error.Message, "needs at least "+strconv.FormatInt(bound, 10)+", 200000 is available") ||
				!strings.Contains(refusal.Error.Message, "at most "+strconv.FormatInt(fits, 10)+" would fit") {
				t.Fatalf("fit off: %d %+v", resp.StatusCode, refusal)
			}

			// Fit on (the default): served with the largest cap that fits.
			st, h, b := p.do("POST", "/v1/chat/completions", k.Key, body)
			if st != 200 || h.Get("X-Escrow-Output-Cap") != strconv.FormatInt(fits, 10) {
				t.Fatalf("fitted: %d cap %q: %s", st, h.Get("X-Escrow-Output-Cap"), b)
			}
			bal := p.settled("small")
			var entries struct {
				Data []struct {
					Delta   int64
					Request struct {
						Cost       int64
						HoldAmount int64 `json:"hold_amount"`
					}
				}
			}
			p.admin("GET", "/orgs/small/entries", nil, http.StatusOK, &entries)
			e := entries.Data[0]
			if want := int64(len(body))*2 + fits*8; e.Request.HoldAmount != want || e.Request.Cost > want || bal.LedgerBalance != 200_000-e.Request.Cost || bal.LedgerBalance < 0 {
				t.Fatalf("entry %+v, balance %+v: want the fitted bound %d held", e, bal, want)
			}

			// A key's daily limit with 40,000 of room left, on a balance that is not short: the
			// next request is fitted to the limit's room.
			p.admin("POST", "/orgs/small/credits", map[string]any{"amount": 1_000_000, "reference": "more-small"}, http.StatusCreated, nil)
			used := e.Request.Cost
			p.admin("POST", "/orgs/small/limits", map[string]any{"scope": "key", "scope_id": k.ID, "window": "day", "cap": used + 40_000}, http.StatusCreated, nil)
			st, h, b = p.do("POST", "/v1/chat/completions", k.Key, body)
			if want := (40_000 - int64(len(body))*2) / 8; st != 200 || h.Get("X-Escrow-Output-Cap") != strconv.FormatInt(want, 10) {
				t.Fatalf("fitted to the limit: %d cap %q, want %d: %s", st, h.Get("X-Escrow-Output-Cap"), want, b)
			}
		})
	}
}
