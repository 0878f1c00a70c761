package server

import (
	"context"
	"fmt"
	"net/http"
	"strings"

	"github.com/llmescrow/escrow/async"
	"github.com/llmescrow/escrow/ledger/batchfile"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/middleware"
)

// The batch APIs (DESIGN.md "Async work", docs/batches.md): the middleware checks, holds and
// records batches (middleware.Batches); the server gives it the job poller, the ledger's batch
// files and its own calls to the upstream of a model.

// batchJobs is the middleware's Batches.Jobs: the server's poller, made after the middleware;
// the upstreams the middleware hands over are registered when it is (openBatches). Begin is
// jobStarter's.
type batchJobs struct{ jobStarter }

type batchPoll struct {
	kind job.Kind
	up   async.Upstream
}

func (b batchJobs) Handle(kind job.Kind, u async.Upstream) {
	b.s.batchPolls = append(b.s.batchPolls, batchPoll{kind, u})
}

func (b batchJobs) Jobs() job.Store {
	js, _ := b.s.ledger.(job.Store)
	return js
}

func (b batchJobs) Kick() {
	if b.s.poller != nil {
		b.s.poller.Kick()
	}
}

// batches is the middleware's Batches: on when the ledger keeps jobs and batch files.
func (s *Server) batches() middleware.Batches {
	files, ok := s.ledger.(batchfile.Store)
	if _, jobs := s.ledger.(job.Store); !ok || !jobs {
		return middleware.Batches{}
	}
	return middleware.Batches{Jobs: batchJobs{jobStarter{s}}, Files: files, Upstream: s.batchUpstream}
}

// openBatches registers the batch kinds' upstreams with the job poller (openJobs).
func (s *Server) openBatches() {
	if s.poller == nil {
		return
	}
	for _, h := range s.batchPolls {
		s.poller.Handle(h.kind, h.up)
	}
}

// batchClient is the client of escrow's own batch calls (a result file may be large: the
// caller's context bounds the call).
var batchClient = &http.Client{}

// batchUpstream sends req (a path and query) to the upstream that serves model in the style of
// req's path, with that upstream's key.
func (s *Server) batchUpstream(ctx context.Context, model string, req *http.Request) (*http.Response, error) {
	u := s.routes.lookup(styleOf(req.URL.Path), model)
	if u == nil {
		return nil, fmt.Errorf("server: no upstream for model %q", model)
	}
	to := *u.base
	to.Path = strings.TrimSuffix(to.Path, "/") + req.URL.Path
	to.RawPath = ""
	to.RawQuery = strings.TrimPrefix(u.base.RawQuery+"&"+req.URL.RawQuery, "&")
	to.RawQuery = strings.TrimSuffix(to.RawQuery, "&")
	req = req.WithContext(ctx)
	req.URL, req.Host = &to, to.Host
	u.setKey(req.Header)
	return batchClient.Do(req)
}
