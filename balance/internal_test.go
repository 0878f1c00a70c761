package balance

import (
	"errors"
	"testing"
)

func TestParseVersion(t *testing.T) {
	for v, want := range map[string][2]int{"7.0.15": {7, 0}, "6.0.0": {6, 0}, "5.0.14": {5, 0}, "6.2": {6, 2}} {
		if ma, mi := parseVersion(v); ma != want[0] || mi != want[1] {
			t.Errorf("parseVersion(%q) = %d.%d", v, ma, mi)
		}
	}
	info := "# Server\r\nredis_version:6.0.9\r\nredis_mode:standalone\r\n"
	if v, ok := infoField(info, "redis_version"); !ok || v != "6.0.9" {
		t.Fatalf("infoField = %q %v", v, ok)
	}
	if _, ok := infoField(info, "missing"); ok {
		t.Fatal("found a missing field")
	}
}

func TestOrgKeys(t *testing.T) {
	s := &Store{prefix: "esc"}
	k := s.keys("acme")
	got := []string{k.Acct, k.Holds, k.Hexp, k.Gone, k.Hfin, k.Lim, k.U}
	want := []string{"esc:{acme}:acct", "esc:{acme}:holds", "esc:{acme}:hexp", "esc:{acme}:gone", "esc:{acme}:hfin", "esc:a:{acme}:lim", "esc:{acme}:u"}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("keys = %q, want %q", got, want)
		}
	}
	pattern, orgOf := s.kindPattern(func(k OrgKeys) string { return k.Hexp })
	if pattern != "esc:{*}:hexp" {
		t.Fatalf("pattern = %q", pattern)
	}
	if org, ok := orgOf("esc:{acme}:hexp"); !ok || org != "acme" {
		t.Fatalf("orgOf = %q %v", org, ok)
	}
	for _, k := range []string{"other:{acme}:hexp", "esc:{a:b}:hexp", "esc:{acme}:holds"} {
		if _, ok := orgOf(k); ok {
			t.Fatalf("orgOf accepted %q", k)
		}
	}
}

func TestErrorClassifiers(t *testing.T) {
	if !isNoScript(errors.New("NOSCRIPT No matching script. Please use EVAL.")) || isNoScript(errors.New("ERR x")) || isNoScript(nil) {
		t.Fatal("isNoScript")
	}
	if !isUnknownCommand(errors.New("ERR unknown command 'CONFIG'")) || isUnknownCommand(errors.New("ERR wrong number")) {
		t.Fatal("isUnknownCommand")
	}
}

func TestObserveEpoch(t *testing.T) {
	s := &Store{}
	s.ObserveEpoch(Epoch{})
	if !s.Epoch().IsZero() || s.epochString() != "0:" {
		t.Fatal("zero epoch cached")
	}
	s.ObserveEpoch(Epoch{Gen: 2, ID: "a"})
	s.ObserveEpoch(Epoch{Gen: 1, ID: "b"}) // lower generation: ignored
	if s.Epoch() != (Epoch{Gen: 2, ID: "a"}) || s.epochString() != "2:a" {
		t.Fatalf("epoch %v", s.Epoch())
	}
	s.ObserveEpoch(Epoch{Gen: 2, ID: "c"}) // same generation, another ledger: replaced
	if s.Epoch() != (Epoch{Gen: 2, ID: "c"}) || s.epochString() != "2:c" {
		t.Fatalf("epoch %v", s.Epoch())
	}
}
