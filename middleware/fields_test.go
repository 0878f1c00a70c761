package middleware

import (
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// TestFoldOrbits proves foldName's premise: the only non-ASCII runes that Unicode simple folding
// (encoding/json's case-insensitive match) takes to an ASCII letter are U+017F and U+212A, and
// foldName maps each to that letter.
func TestFoldOrbits(t *testing.T) {
	t.Parallel()
	found := map[rune]rune{}
	for r := rune(utf8.RuneSelf); r <= unicode.MaxRune; r++ {
		for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
			if f < utf8.RuneSelf {
				found[r] = unicode.ToLower(f)
			}
		}
	}
	want := map[rune]rune{'\u017f': 's', '\u212a': 'k'}
	if len(found) != len(want) || found['\u017f'] != 's' || found['\u212a'] != 'k' {
		t.Fatalf("non-ASCII runes folding to ASCII: %q, foldName knows %q", found, want)
	}
	for r, c := range want {
		var buf [maxFold]byte
		if f, ok := foldName(buf[:0], string(r)); !ok || string(f) != string(c) {
			t.Fatalf("foldName(%q) = %q %v, want %q", r, f, ok, c)
		}
	}
}

// TestFoldName: two keys fold alike exactly when encoding/json (strings.EqualFold) or
// encoding/json/v2 case:ignore (EqualFold ignoring "_" and "-") would take them for one name.
func TestFoldName(t *testing.T) {
	t.Parallel()
	same := [][2]string{
		{"max_tokens", "MAX_TOKENS"}, {"max_tokens", "Max_Tokens"}, {"max_tokens", "maxTokens"}, {"max_tokens", "max-tokens"},
		{"stream", "\u017ftream"}, {"stream", "STREAM"}, {"max_tokens", "max_to\u212aens"}, {"n", "N"}, {"n", "_n_"},
		{"best_of", "BestOf"}, {"include_usage", "include__usage"},
	}
	for _, p := range same {
		var a, b [maxFold]byte
		fa, oka := foldName(a[:0], p[0])
		fb, okb := foldName(b[:0], p[1])
		if !oka || !okb || string(fa) != string(fb) {
			t.Errorf("%q and %q: folded %q %v, %q %v; want equal", p[0], p[1], fa, oka, fb, okb)
		}
	}
	differ := [][2]string{{"model", "models"}, {"stream", "stream_options"}, {"n", "m"}, {"model", "mod el"}, {"type", "typé"}}
	for _, p := range differ {
		var a, b [maxFold]byte
		fa, _ := foldName(a[:0], p[0])
		fb, okb := foldName(b[:0], p[1])
		if okb && string(fa) == string(fb) {
			t.Errorf("%q and %q fold alike (%q)", p[0], p[1], fa)
		}
	}
	// A key too long to be any field folds to nothing, without allocating past the buffer.
	if _, ok := foldName(make([]byte, 0, maxFold), strings.Repeat("a", maxFold+1)); ok {
		t.Fatal("an over-long key folded")
	}
}

// TestFieldCheckNoAlloc: checking a key costs no allocation (it runs for every key of every
// message). AllocsPerRun counts the whole process, so the least of a few runs is the check's.
func TestFieldCheckNoAlloc(t *testing.T) {
	least := -1.0
	for range 5 {
		n := testing.AllocsPerRun(100, func() {
			var seen uint64
			topFields.check("Max_Completion_Tokens", &seen)
			topFields.check("max_completion_tokens", &seen)
			topFields.check("ſtream", &seen)
		})
		if least < 0 || n < least {
			least = n
		}
	}
	if least != 0 {
		t.Fatalf("check allocates %.0f times", least)
	}
}

func TestFieldSetCheck(t *testing.T) {
	t.Parallel()
	var seen uint64
	steps := []struct {
		key  string
		want keyCheck
	}{
		{"model", keyOK}, {"temperature", keyOK}, {"Model", keyVariant}, {"model", keyDuplicate},
		{"mod\u0065l", keyDuplicate}, {"foo", keyUnknown}, {"foo", keyUnknown}, {"ſtream", keyVariant}, {"stream", keyOK},
	}
	for _, s := range steps {
		if _, got := topFields.check(s.key, &seen); got != s.want {
			t.Fatalf("check(%q) = %d, want %d", s.key, got, s.want)
		}
	}
}

func TestSkipString(t *testing.T) {
	t.Parallel()
	for _, s := range []string{`""`, `"a"`, `"a\"b"`, `"a\\"`, `"a\\\"b"`, `"\\\\"`, `"\"\""`, `"x\\\\\"y\\"`} {
		if got := skipString(s+`,"next"`, 0); got != len(s) {
			t.Errorf("skipString(%s) = %d, want %d", s, got, len(s))
		}
	}
	if got := skipString(`"unterminated\"`, 0); got != len(`"unterminated\"`) {
		t.Errorf("unterminated: %d", got)
	}
}
