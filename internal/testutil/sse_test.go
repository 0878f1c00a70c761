package testutil

import (
	"errors"
	"testing"
)

// TestSDKStream: comments are skipped; an unknown event name still reaches the caller (why
// escrow's cost goes in a comment, never in an `event: escrow` event); [DONE] ends the stream;
// an event that is not JSON fails.
func TestSDKStream(t *testing.T) {
	t.Parallel()
	items, done, err := SDKStream("data: {\"a\":1}\n\n: escrow {\"cost\":5}\n\nevent: escrow\ndata: {\"cost\":5}\n\r\ndata: [DONE]\n\ndata: {\"late\":1}\n\n")
	if err != nil || !done || len(items) != 2 || items[0]["a"] != float64(1) || items[1]["cost"] != float64(5) {
		t.Fatalf("items %v done %v err %v", items, done, err)
	}
	if _, _, err := SDKStream("data: not json\n\n"); err == nil {
		t.Fatal("a non-JSON event decoded")
	}
	if _, _, err := SDKStream("data: {}\n"); !errors.Is(err, ErrSSEIncomplete) {
		t.Fatalf("cut stream: %v", err)
	}
	c, cost, bal, ok, err := CostComment("data: {}\n\n: escrow {\"cost\":7,\"balance\":93}\n\ndata: [DONE]\n\n")
	if !ok || err != nil || cost != 7 || bal != 93 || c != ": escrow {\"cost\":7,\"balance\":93}\n\n" {
		t.Fatalf("comment %q %d %d %v %v", c, cost, bal, ok, err)
	}
	if _, _, bal, ok, err := CostComment(": escrow {\"cost\":7}\n\n"); !ok || err != nil || bal != -1 {
		t.Fatalf("no balance: %d %v %v", bal, ok, err)
	}
	if _, _, _, ok, err := CostComment("data: {}\n: escrow {\"cost\":7}\n\n"); !ok || err == nil {
		t.Fatalf("a comment inside an event: %v %v", ok, err)
	}
	if _, _, _, ok, _ := CostComment("data: {}\n\n"); ok {
		t.Fatal("found a comment in a stream without one")
	}
}
