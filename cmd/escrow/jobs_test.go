package main

import (
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestCLIJobs: a background response started through the proxy is listed by `escrow jobs` (every
// org's, and the org's own) with its status and hold while it runs, and with its cost and no
// hold left among the live ones once the poller settled it.
func TestCLIJobs(t *testing.T) {
	c, base := startCLIProxy(t)
	c.ok("orgs", "create", "acme")
	var k struct{ Key string }
	c.json(&k, "keys", "create", "acme")
	c.ok("models", "set", "gpt-4o-mini", "--input", "1", "--output", "1", "--max-output-tokens", "1000", "--default-hold", "50000")
	c.ok("credit", "acme", "10000000", "--ref", "pay-1")
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/responses",
		strings.NewReader(`{"model":"gpt-4o-mini","background":true,"input":"hello jobs"}`))
	req.Header.Set("Authorization", "Bearer "+k.Key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("background create: %d", resp.StatusCode)
	}
	type jobRow struct {
		ID, Kind, Org, Status string
		UpstreamID            string `json:"upstream_id"`
		Hold, Cost            int64
		SettledAt             *time.Time `json:"settled_at"`
	}
	var all struct{ Jobs []jobRow }
	c.json(&all, "jobs")
	if len(all.Jobs) != 1 || all.Jobs[0].Org != "acme" || all.Jobs[0].Kind != "background_response" || all.Jobs[0].Hold <= 0 ||
		!strings.HasPrefix(all.Jobs[0].UpstreamID, "resp") {
		t.Fatalf("escrow jobs: %+v", all)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		var mine struct{ Jobs []jobRow }
		c.json(&mine, "jobs", "acme")
		if len(mine.Jobs) == 1 && mine.Jobs[0].SettledAt != nil {
			// the fake's 20 output tokens and the input's 2 words, at 1 per token
			if mine.Jobs[0].Status != "completed" || mine.Jobs[0].Cost != 22 {
				t.Fatalf("settled job %+v", mine.Jobs[0])
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the job never settled: %+v", mine)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var live struct{ Jobs []jobRow }
	c.json(&live, "jobs", "--live")
	if len(live.Jobs) != 0 {
		t.Fatalf("escrow jobs --live after the end: %+v", live)
	}
	if out := c.ok("jobs", "acme"); !strings.Contains(out, "completed") || !strings.Contains(out, "background_response") {
		t.Fatalf("table:\n%s", out)
	}
}
