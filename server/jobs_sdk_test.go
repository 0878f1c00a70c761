package server

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"
)

// TestOpenAINodeSDKBackground: the official openai npm package drives a background response end
// to end (sdktest/background.mjs): created (queued), retrieved until it completes, its input
// items listed, refused with the SDK's NotFoundError to another org, and a second one cancelled.
// The ledger charges each exactly the usage the SDK read, once.
func TestOpenAINodeSDKBackground(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "openai")
	_, tweak := jobsUpstream(t, 600*time.Millisecond)
	p := startTestProxy(t, true, tweak)
	const funds = 1_000_000
	key := p.setupJobs("sdk", funds)
	other := p.setupJobs2("sdk-other", funds)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out := runSDK(ctx, t, node, "background.mjs", []string{"ESCROW_BASE_URL=" + p.base, "ESCROW_KEY=" + key,
		"ESCROW_OTHER_KEY=" + other, "ESCROW_MODEL=m"}, nil)
	type usage struct {
		Input  int64 `json:"input_tokens"`
		Output int64 `json:"output_tokens"`
	}
	var res struct {
		ID       string   `json:"id"`
		Statuses []string `json:"statuses"`
		Text     string   `json:"text"`
		Usage    *usage   `json:"usage"`
		Items    []string `json:"items"`
		Other    struct {
			Status   int  `json:"status"`
			NotFound bool `json:"notFound"`
		} `json:"other"`
		Cancelled struct {
			Status string `json:"status"`
			Usage  *usage `json:"usage"`
		} `json:"cancelled"`
	}
	if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
		t.Fatalf("node output %s: %v", out, err)
	}
	if len(res.Statuses) < 2 || res.Statuses[0] != "queued" || res.Statuses[len(res.Statuses)-1] != "completed" ||
		res.Usage == nil || res.Usage.Output <= 0 || res.Text == "" {
		t.Fatalf("the SDK's background response: %s", out)
	}
	if !slices.Equal(res.Items, []string{"message"}) {
		t.Errorf("input items %v", res.Items)
	}
	if res.Other.Status != 404 || !res.Other.NotFound {
		t.Errorf("another org read it: %+v, want 404 NotFoundError", res.Other)
	}
	if res.Cancelled.Status != "cancelled" || res.Cancelled.Usage == nil {
		t.Fatalf("cancelled: %s", out)
	}
	p.jobsDone()
	b := p.settled("sdk")
	// 1 µ per input and output token: charged exactly what the SDK read, once each.
	want := res.Usage.Input + res.Usage.Output + res.Cancelled.Usage.Input + res.Cancelled.Usage.Output
	if b.LedgerBalance != funds-want || b.Held != 0 {
		t.Fatalf("balance %+v, want ledger %d (charged %d)", b, funds-want, want)
	}
	if es := ledgerCharges(t, p, "sdk"); len(es) != 2 {
		t.Fatalf("charges %v, want one per response", es)
	}
}
