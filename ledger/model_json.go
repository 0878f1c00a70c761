package ledger

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/llmescrow/escrow/pricing"
)

// PriceSuffix ends the JSON member of each price class of a Model: "input_price",
// "audio_output_price", "per_image_1024x1024_hd_price".
const PriceSuffix = "_price"

// modelFields are a Model's members that are not prices.
type modelFields struct {
	Name            string `json:"model"`
	MaxInputTokens  int64  `json:"max_input_tokens"`
	MaxOutputTokens int64  `json:"max_output_tokens"`
	MaxCost         int64  `json:"max_cost"`
	DefaultHold     int64  `json:"default_hold"`
}

var modelKeys = map[string]bool{"model": true, "max_input_tokens": true, "max_output_tokens": true, "max_cost": true, "default_hold": true}

// MarshalJSON writes the model's name, one member "<class>_price" per class it prices in the
// registry's order (a new class needs no code here), then its limits.
func (m Model) MarshalJSON() ([]byte, error) {
	b := bytes.NewBufferString(`{"model":`)
	name, err := json.Marshal(m.Name)
	if err != nil {
		return nil, err
	}
	b.Write(name)
	for _, c := range m.Prices.Sorted() {
		fmt.Fprintf(b, ",%q:%d", string(c)+PriceSuffix, m.Prices[c])
	}
	fmt.Fprintf(b, `,"max_input_tokens":%d,"max_output_tokens":%d,"max_cost":%d,"default_hold":%d}`,
		m.MaxInputTokens, m.MaxOutputTokens, m.MaxCost, m.DefaultHold)
	return b.Bytes(), nil
}

// UnmarshalJSON reads MarshalJSON's form; a member ending in "_price" that names no class
// (pricing.ErrUnknownClass) or any other unknown member (ErrInvalidAmount) is an error.
func (m *Model) UnmarshalJSON(b []byte) error {
	var f modelFields
	if err := json.Unmarshal(b, &f); err != nil {
		return err
	}
	var all map[string]json.RawMessage
	if err := json.Unmarshal(b, &all); err != nil {
		return err
	}
	*m = Model{Name: f.Name, MaxInputTokens: f.MaxInputTokens, MaxOutputTokens: f.MaxOutputTokens, MaxCost: f.MaxCost, DefaultHold: f.DefaultHold}
	for k, raw := range all {
		name, ok := strings.CutSuffix(k, PriceSuffix)
		switch {
		case !ok && !modelKeys[k]:
			return fmt.Errorf("%w: unknown field %q", ErrInvalidAmount, k)
		case !ok || string(raw) == "null":
			continue
		}
		c, err := pricing.ParseClass(name)
		if err != nil {
			return fmt.Errorf("%s: %w", k, err)
		}
		var v int64
		if err := json.Unmarshal(raw, &v); err != nil {
			return fmt.Errorf("%s: %w", k, err)
		}
		if m.Prices == nil {
			m.Prices = pricing.Prices{}
		}
		m.Prices[c] = v
	}
	return nil
}
