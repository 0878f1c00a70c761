package endpoint

import "strings"

// The batch APIs (DESIGN.md "Async work"): OpenAI's Files and Batches, whose input file holds
// one request per line for an endpoint with Spec.Batch, and Anthropic's Message Batches, whose
// requests are inline. Their routes are matched here, like every endpoint, and nowhere else.

// BatchOp is one route of the batch APIs.
type BatchOp uint8

// The routes.
const (
	FileUpload      BatchOp = iota + 1 // POST /v1/files
	FileList                           // GET /v1/files
	FileGet                            // GET /v1/files/{id}
	FileContent                        // GET /v1/files/{id}/content
	FileDelete                         // DELETE /v1/files/{id}
	BatchCreate                        // POST /v1/batches
	BatchList                          // GET /v1/batches
	BatchGet                           // GET /v1/batches/{id}
	BatchCancel                        // POST /v1/batches/{id}/cancel
	MsgBatchCreate                     // POST /v1/messages/batches
	MsgBatchList                       // GET /v1/messages/batches
	MsgBatchGet                        // GET /v1/messages/batches/{id}
	MsgBatchResults                    // GET /v1/messages/batches/{id}/results
	MsgBatchCancel                     // POST /v1/messages/batches/{id}/cancel
	MsgBatchDelete                     // DELETE /v1/messages/batches/{id}
)

// BatchRoute is a request of the batch APIs: its route and the id in its path ("" for none).
type BatchRoute struct {
	Op       BatchOp
	ID       string
	Provider Provider
}

// Batch API limits of the upstreams, which escrow applies as it reads.
const (
	// MaxBatchFileBytes is the largest batch input file OpenAI takes (200 MB).
	MaxBatchFileBytes = 200 << 20
	// MaxBatchLines is the most requests one batch may hold (OpenAI: 50,000 lines; Anthropic:
	// 100,000 requests).
	MaxBatchLines = 100_000
	// MaxMsgBatchBytes is the largest Message Batches create body Anthropic takes (256 MB).
	MaxMsgBatchBytes = 256 << 20
)

var batchRoutes = []struct {
	method, base, sub string
	id                bool
	op                BatchOp
}{
	{"POST", "/v1/files", "", false, FileUpload},
	{"GET", "/v1/files", "", false, FileList},
	{"GET", "/v1/files", "", true, FileGet},
	{"GET", "/v1/files", "content", true, FileContent},
	{"DELETE", "/v1/files", "", true, FileDelete},
	{"POST", "/v1/batches", "", false, BatchCreate},
	{"GET", "/v1/batches", "", false, BatchList},
	{"GET", "/v1/batches", "", true, BatchGet},
	{"POST", "/v1/batches", "cancel", true, BatchCancel},
	{"POST", "/v1/messages/batches", "", false, MsgBatchCreate},
	{"GET", "/v1/messages/batches", "", false, MsgBatchList},
	{"GET", "/v1/messages/batches", "", true, MsgBatchGet},
	{"GET", "/v1/messages/batches", "results", true, MsgBatchResults},
	{"POST", "/v1/messages/batches", "cancel", true, MsgBatchCancel},
	{"DELETE", "/v1/messages/batches", "", true, MsgBatchDelete},
}

// IsBatchPath reports whether path belongs to the batch APIs (any method).
func IsBatchPath(path string) bool {
	for _, b := range []string{"/v1/files", "/v1/batches", "/v1/messages/batches"} {
		if path == b || strings.HasPrefix(path, b+"/") {
			return true
		}
	}
	return false
}

// LookupBatch matches a request of the batch APIs; ok is false for any other method and path.
func LookupBatch(method, path string) (BatchRoute, bool) {
	for _, r := range batchRoutes {
		rest, ok := strings.CutPrefix(path, r.base)
		if !ok || r.method != method {
			continue
		}
		if !r.id {
			if rest == "" {
				return BatchRoute{Op: r.op, Provider: providerOf(r.base)}, true
			}
			continue
		}
		id, sub, _ := strings.Cut(strings.TrimPrefix(rest, "/"), "/")
		if !strings.HasPrefix(rest, "/") || id == "" || sub != r.sub {
			continue
		}
		return BatchRoute{Op: r.op, ID: id, Provider: providerOf(r.base)}, true
	}
	return BatchRoute{}, false
}

func providerOf(base string) Provider {
	if base == "/v1/messages/batches" {
		return Anthropic
	}
	return OpenAI
}
