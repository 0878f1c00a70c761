package ledgertest

import (
	"testing"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/batchfile"
	"github.com/llmescrow/escrow/pricing"
)

// batchFileTests run on every ledger: each must implement batchfile.Store.
var batchFileTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"BatchFiles", testBatchFiles},
}

// testBatchFiles: a file is recorded for one org (again for it: no change; for another:
// ErrConflict), read back whole, listed only for its org, newest first, and forgotten.
func testBatchFiles(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	s, ok := l.(batchfile.Store)
	if !ok {
		t.Fatalf("%T does not implement batchfile.Store", l)
	}
	f := batchfile.File{ID: "file-1", Org: "acme", KeyID: "key_1", Purpose: batchfile.PurposeBatch, Filename: "in.jsonl",
		Bytes: 300, Endpoint: "/v1/chat/completions", Model: "gpt-test", Lines: 3, Bound: 900, Estimate: 90, MaxLine: 400,
		Prices: pricing.Prices{pricing.Input: 500_000, pricing.Output: 1_000_000, pricing.BatchDiscount: 0}}
	wantErr(t, s.RecordFile(c, f), ledger.ErrUnknownOrg, "RecordFile of an unknown org")
	noErr(t, l.CreateOrg(c, "acme"))
	noErr(t, l.CreateOrg(c, "other"))
	for _, bad := range []func(*batchfile.File){
		func(f *batchfile.File) { f.ID = "" },
		func(f *batchfile.File) { f.Purpose = "assistants" },
		func(f *batchfile.File) { f.Estimate = f.Bound + 1 },
		func(f *batchfile.File) { f.MaxLine = f.Bound + 1 },
		func(f *batchfile.File) { f.Org = "bad{org}" },
	} {
		g := f
		bad(&g)
		wantErr(t, s.RecordFile(c, g), batchfile.ErrInvalid, "RecordFile of an invalid file")
	}
	noErr(t, s.RecordFile(c, f))
	noErr(t, s.RecordFile(c, f)) // again for its org: no change
	g := f
	g.Org = "other"
	wantErr(t, s.RecordFile(c, g), batchfile.ErrConflict, "the same id for another org")
	out := batchfile.File{ID: "file-2", Org: "acme", Purpose: batchfile.PurposeOutput, Model: "gpt-test", Batch: "batch_1"}
	noErr(t, s.RecordFile(c, out))

	got, err := s.File(c, "file-1")
	noErr(t, err)
	if got.Org != "acme" || got.Bound != 900 || got.Estimate != 90 || got.MaxLine != 400 || got.Lines != 3 || got.Model != "gpt-test" ||
		got.Endpoint != f.Endpoint || got.Filename != "in.jsonl" || got.Bytes != 300 || !got.Prices.Equal(f.Prices) ||
		got.Prices[pricing.BatchDiscount] != 0 || got.CreatedAt.IsZero() {
		t.Fatalf("File = %+v", got)
	}
	list, err := s.Files(c, "acme", 0)
	noErr(t, err)
	if len(list) != 2 || list[0].ID != "file-2" || list[1].ID != "file-1" {
		t.Fatalf("Files(acme) = %+v", list)
	}
	if list, err := s.Files(c, "other", 0); err != nil || len(list) != 0 {
		t.Fatalf("Files(other) = %+v %v", list, err)
	}
	noErr(t, s.DeleteFile(c, "file-1"))
	_, err = s.File(c, "file-1")
	wantErr(t, err, batchfile.ErrUnknownFile, "File after DeleteFile")
	wantErr(t, s.DeleteFile(c, "file-1"), batchfile.ErrUnknownFile, "DeleteFile twice")
	if list, _ := s.Files(c, "acme", 0); len(list) != 1 {
		t.Fatalf("Files after a delete = %+v", list)
	}
}
