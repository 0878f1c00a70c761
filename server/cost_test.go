package server

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/internal/testutil"
)

// send posts a JSON body with the key and the extra headers, and returns the response with its
// body read whole (so that its trailers have arrived).
func (p *testProxy) send(path, key, body string, hdr map[string]string) (*http.Response, string) {
	p.t.Helper()
	req, err := http.NewRequest(http.MethodPost, p.base+path, strings.NewReader(body))
	if err != nil {
		p.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		p.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		p.t.Fatal(err)
	}
	return resp, string(b)
}

// charge is the ledger's charge for a request, by its x-request-id.
func (p *testProxy) charge(id string) int64 {
	p.t.Helper()
	var r struct {
		Cost int64 `json:"cost"`
	}
	p.admin("GET", "/requests/"+id, nil, http.StatusOK, &r)
	return r.Cost
}

func atoi(t *testing.T, what, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatalf("%s %q: %v", what, s, err)
	}
	return n
}

// TestCostOnResponses (issue 14, cost on every response) over the whole proxy, on every
// backend, one request at a time: a JSON response carries x-escrow-cost = the ledger's charge
// and x-escrow-balance = the org's available balance after it (the admin API's, with nothing
// in flight), and each call lowers it by exactly its cost; a body too large to hold (a MiB and
// more) has both as HTTP trailers; a stream carries them in an SSE comment before [DONE] only
// when asked, and an OpenAI SDK parser reads the same chunks either way.
func TestCostOnResponses(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		key := p.setup("payer", 10_000_000, 50_000) // model m: 1 µ per output token, input free
		p.admin("PUT", "/models/big", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
			"max_input_tokens": 100_000, "max_output_tokens": 16_384, "max_cost": 0, "default_hold": 200_000}, http.StatusOK, nil)
		msg := `"messages":[{"role":"user","content":"hello there"}]`
		prev := p.balance("payer").Available

		// Two JSON calls in a row: the balance drops by exactly each cost.
		for i, tokens := range []int{7, 11} {
			resp, body := p.send("/v1/chat/completions", key, `{"model":"m",`+msg+`,"max_tokens":`+strconv.Itoa(tokens)+`}`, nil)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("call %d: %d %s", i, resp.StatusCode, body)
			}
			cost := atoi(t, "x-escrow-cost", resp.Header.Get("X-Escrow-Cost"))
			bal := atoi(t, "x-escrow-balance", resp.Header.Get("X-Escrow-Balance"))
			if charged := p.charge(resp.Header.Get("X-Request-Id")); cost != charged || cost != int64(tokens) {
				t.Fatalf("call %d: x-escrow-cost %d, ledger %d, want %d", i, cost, charged, tokens)
			}
			if avail := p.balance("payer").Available; bal != avail || bal != prev-cost {
				t.Fatalf("call %d: x-escrow-balance %d, available %d, previous %d − cost %d", i, bal, avail, prev, cost)
			}
			prev = bal
		}

		// 10 choices × 16,384 tokens: a 1.4 MB body streams past the 1 MiB kept whole, so the
		// cost and the balance come as trailers.
		// ([fill]: the fake's answer fills its cap instead of stopping at 20 words.)
		resp, body := p.send("/v1/chat/completions", key, `{"model":"big","messages":[{"role":"user","content":"[fill] hello there"}],"n":10,"max_tokens":16384}`, nil)
		if resp.StatusCode != http.StatusOK || len(body) < 1<<20 || resp.Header.Get("X-Escrow-Cost") != "" || resp.ContentLength != -1 {
			t.Fatalf("large: %d, %d bytes, header cost %q, length %d", resp.StatusCode, len(body), resp.Header.Get("X-Escrow-Cost"), resp.ContentLength)
		}
		cost := atoi(t, "trailer x-escrow-cost", resp.Trailer.Get("X-Escrow-Cost"))
		bal := atoi(t, "trailer x-escrow-balance", resp.Trailer.Get("X-Escrow-Balance"))
		if charged := p.charge(resp.Header.Get("X-Request-Id")); cost != charged || cost != 10*16_384 {
			t.Fatalf("large: trailer cost %d, ledger %d", cost, charged)
		}
		if avail := p.balance("payer").Available; bal != avail || bal != prev-cost {
			t.Fatalf("large: trailer balance %d, available %d, previous %d − cost %d", bal, avail, prev, cost)
		}
		prev = bal

		// A stream: the comment only when asked, before [DONE].
		stream := `{"model":"m",` + msg + `,"max_tokens":5,"stream":true}`
		_, plain := p.send("/v1/chat/completions", key, stream, nil)
		if _, _, _, found, _ := testutil.CostComment(plain); found || strings.Contains(plain, "escrow") {
			t.Fatalf("a stream that did not ask got the cost: %q", plain)
		}
		prev = p.balance("payer").Available
		resp, asked := p.send("/v1/chat/completions", key, stream, map[string]string{"X-Escrow-Include-Cost": "true"})
		comment, cost, bal, found, err := testutil.CostComment(asked)
		if !found || err != nil || !strings.HasPrefix(asked[strings.Index(asked, comment)+len(comment):], "data: [DONE]") {
			t.Fatalf("comment %q (%v, %v) in %q", comment, found, err, asked)
		}
		if charged := p.charge(resp.Header.Get("X-Request-Id")); cost != charged || cost != 5 {
			t.Fatalf("stream: comment cost %d, ledger %d", cost, charged)
		}
		if avail := p.balance("payer").Available; bal != avail || bal != prev-cost {
			t.Fatalf("stream: comment balance %d, available %d, previous %d − cost %d", bal, avail, prev, cost)
		}
		a, doneA, errA := testutil.SDKStream(plain)
		b, doneB, errB := testutil.SDKStream(asked)
		if errA != nil || errB != nil || !doneA || !doneB || len(a) == 0 || len(a) != len(b) {
			t.Fatalf("SDK: %d items (%v, %v) without, %d (%v, %v) with the comment", len(a), doneA, errA, len(b), doneB, errB)
		}
		for i := range b {
			if b[i]["object"] != "chat.completion.chunk" {
				t.Fatalf("item %d is not a chunk: %v", i, b[i])
			}
		}
	})
}
