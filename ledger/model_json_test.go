package ledger_test

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// TestModelJSON: a model's JSON has one member "<class>_price" per class it prices (any class
// of the registry, none written by hand), in the registry's order, and reads back the same; a
// "_price" member that names no class, or any unknown member, is refused.
func TestModelJSON(t *testing.T) {
	t.Parallel()
	m := ledger.Model{Name: "gpt-audio", Prices: pricing.Prices{pricing.Output: 10, pricing.Input: 2, pricing.AudioInput: 40,
		pricing.PerImage("1024x1024", "hd"): 80_000}, MaxInputTokens: 5, MaxOutputTokens: 6, MaxCost: 7, DefaultHold: 8}
	b, err := json.Marshal(m)
	want := `{"model":"gpt-audio","input_price":2,"audio_input_price":40,"output_price":10,"per_image_1024x1024_hd_price":80000,` +
		`"max_input_tokens":5,"max_output_tokens":6,"max_cost":7,"default_hold":8}`
	if err != nil || string(b) != want {
		t.Fatalf("Marshal = %s %v\nwant %s", b, err, want)
	}
	var back ledger.Model
	if err := json.Unmarshal(b, &back); err != nil || !reflect.DeepEqual(back, m) {
		t.Fatalf("Unmarshal = %+v %v", back, err)
	}
	if err := json.Unmarshal([]byte(`{"model":"x","nope_price":1}`), &back); !errors.Is(err, pricing.ErrUnknownClass) {
		t.Fatalf("unknown class: %v", err)
	}
	if err := json.Unmarshal([]byte(`{"model":"x","colour":"red"}`), &back); err == nil {
		t.Fatal("unknown member accepted")
	}
}
