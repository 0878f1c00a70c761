package endpoint

import "testing"

// TestSpecs: every billed spec names the cap fields its upstream reads (or has no output), a
// fit field among them, and each cap field belongs to exactly one of "reads" and "foreign".
func TestSpecs(t *testing.T) {
	for _, s := range All() {
		if Lookup(s.Path) != s {
			t.Fatalf("%s: lookup", s.Path)
		}
		if !s.Billed {
			continue
		}
		if s.NoOutput != (len(s.CapFields) == 0) || (!s.NoOutput && !s.Reads(s.FitField)) {
			t.Errorf("%s: cap fields %v, fit field %q, no output %v", s.Path, s.CapFields, s.FitField, s.NoOutput)
		}
		for _, f := range CapNames {
			if s.Reads(f) == s.Foreign(f) {
				t.Errorf("%s: %s both read and foreign, or neither", s.Path, f)
			}
		}
		if s.Free || s.Prove != nil {
			// Billed from what the request proves (or free): no usage is read.
			if s.UsageJSON != "" || !s.NoOutput || s.EndUserField == "" || (s.Free == (s.Prove != nil)) {
				t.Errorf("%s: proven/free spec: usage %q, no output %v, end user %q", s.Path, s.UsageJSON, s.NoOutput, s.EndUserField)
			}
			continue
		}
		if s.UsageJSON == "" || len(s.Classes) == 0 || s.EndUserField == "" {
			t.Errorf("%s: usage %q, classes %v, end user %q", s.Path, s.UsageJSON, s.Classes, s.EndUserField)
		}
	}
	if Lookup("/v1/models") != nil {
		t.Fatal("an unmetered path has a spec")
	}
}

func TestUpstreamCap(t *testing.T) {
	for _, c := range []struct {
		s              *Spec
		sent, max, cap int64
	}{
		{Chat, 0, 1000, 1000}, {Chat, 50, 1000, 50}, {Responses, 0, 0, 0},
		{Completions, 0, 1000, 16}, {Completions, 300, 1000, 300}, {Embeddings, 5, 1000, 0},
	} {
		if got := c.s.UpstreamCap(c.sent, c.max); got != c.cap {
			t.Errorf("%s: UpstreamCap(%d, %d) = %d, want %d", c.s.Path, c.sent, c.max, got, c.cap)
		}
	}
}

// TestThinking: a budget stays below the cap and at least the minimum, or there is none.
func TestThinking(t *testing.T) {
	for _, c := range []struct {
		budget, cap, want int64
		ok                bool
	}{
		{0, 500, 0, true}, {2000, 5000, 2000, true}, {50_000, 19_946, 19_945, true},
		{50_000, 1025, 1024, true}, {50_000, 1024, 0, false}, {1024, 1024, 0, false},
	} {
		got, ok := Messages.Thinking(c.budget, c.cap)
		if got != c.want || ok != c.ok {
			t.Errorf("Thinking(%d, %d) = %d, %v; want %d, %v", c.budget, c.cap, got, ok, c.want, c.ok)
		}
	}
	if Messages.MinCap(2000) != 1025 || Messages.MinCap(0) != 0 || Chat.MinCap(2000) != 0 {
		t.Fatal("MinCap")
	}
	if Chat.ImageTokens("low", 0) != 85 || Chat.ImageTokens("auto", 0) != 1445 || Chat.ImageTokens("high", 48_169) != 48_169 {
		t.Fatal("ImageTokens")
	}
}
