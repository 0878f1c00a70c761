# escrow — the few targets people expect.
GO        ?= go
REDIS_URL ?= redis://127.0.0.1:6379/0
DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test?sslmode=disable
FUZZTIME  ?= 10s

export ESCROW_TEST_REDIS_URL    = $(REDIS_URL)
export ESCROW_TEST_DATABASE_URL = $(DATABASE_URL)

# NORACE runs the steps built without the race detector (go vet, the simulation, the model check)
# with cgo off, as the image's static build and the binaries the tests build: one build
# configuration, compiled once on an empty build cache (the race build is the other).
NORACE = CGO_ENABLED=0

# RACE_FIRST are the packages whose tests run longest, named before ./... so that go test starts
# them first (it keeps the order given, each package once): the last one to start no longer runs
# alone for minutes at the end while the other core idles.
RACE_FIRST = ./server ./balance ./middleware ./cmd/escrow ./accounting ./ledger/pgledger ./scripts/image

.PHONY: test test-fast services sdk spin modelcheck simulation lint fuzz bench bench-console run image

## test: start Redis and Postgres if needed, then lint and run every test (race detector) on the
## real services, every fuzz target's seed corpus included; then the simulation beside the model
## check. Fuzzing for time is `make fuzz` (CI runs it after `make test`).
test: services sdk lint
	ESCROW_REQUIRE_SERVICES=1 $(GO) test -race -count=1 -timeout 20m $(RACE_FIRST) ./...
	$(MAKE) -j2 --output-sync=target simulation modelcheck

## simulation: the randomized simulation on both backends, without the race detector.
simulation: services
	@echo "simulation: up to 10,000 steps per backend (at most 2 minutes each, at least 500 steps), without the race detector"
	ESCROW_REQUIRE_SERVICES=1 $(NORACE) $(GO) test -count=1 -timeout 10m -run '^TestSimulation$$' ./accounting/

## test-fast: the suite on miniredis and the memory ledger; no services needed.
test-fast:
	ESCROW_TEST_REDIS_URL= ESCROW_TEST_DATABASE_URL= $(GO) test -count=1 ./...

services:
	bash scripts/services.sh

## sdk: the official SDKs the SDK tests drive the proxy with (npm ci in sdktest/).
sdk:
	bash scripts/sdktest.sh

spin:
	bash scripts/spin.sh

## modelcheck: SPIN on docs/model/escrow.pml — the intact model exhaustively (no violation), each
## rule's mutation caught, each counterexample replayed on the real scripts. Fails if spin is missing.
modelcheck: spin
	ESCROW_MODELCHECK=1 $(NORACE) $(GO) test -count=1 -timeout 20m -run '^TestModelCheck$$' -v ./internal/modelcheck/

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null; git ls-files -o --exclude-standard '*.go' 2>/dev/null)); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(NORACE) $(GO) vet ./...

## fuzz: each fuzz target for FUZZTIME (10 s) with the fuzzer's mutations (`make test` runs only
## their seeds). Targets are found in the sources (a `go test -list` per package would build
## every test binary a second time, without the race detector).
fuzz:
	@git ls-files '*_test.go' | xargs grep -H '^func Fuzz' | while IFS=: read -r file decl; do \
	  f=$${decl#func }; f=$${f%%(*}; pkg=./$$(dirname "$$file"); \
	  echo "fuzz $$pkg $$f"; \
	  $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	done

## bench: the benchmark table (limits of Redis and Postgres, proxy without and with escrow, settle
## lag at 2,000 req/s) on the real services, in one run of under 5 minutes; see docs/performance.md.
## BENCHFLAGS passes flags to ./bench (e.g. BENCHFLAGS='-profile /tmp/prof').
bench: services
	bash scripts/wrk.sh
	$(GO) run ./bench -redis-url '$(REDIS_URL)' -database-url '$(DATABASE_URL)' $(BENCHFLAGS)

## bench-console: the operator's reads on a ledger of 10,000,000 charges (filled in a schema of
## its own on DATABASE_URL, dropped afterwards); BENCH_CONSOLE_ROWS changes the size.
BENCH_CONSOLE_ROWS ?= 10000000
bench-console: services
	ESCROW_TEST_DATABASE_URL='$(DATABASE_URL)' ESCROW_BENCH_CONSOLE_ROWS=$(BENCH_CONSOLE_ROWS) \
	  $(GO) test ./ledger/pgledger -run '^$$' -bench BenchmarkConsoleLarge -benchtime 50x -timeout 60m -v

## run: the example proxy (embedded defaults when REDIS_URL/DATABASE_URL are unset in the environment).
run:
	$(GO) run ./examples/proxy

## image: a static binary (CGO_ENABLED=0) in an image FROM scratch (CA bundle, non-root user, no
## shell), written without a container engine as one tarball (OCI layout + docker archive):
## docker load -i $(IMAGE). See docs/deploy.md.
IMAGE ?= bin/escrow-image.tar
IMAGE_TAG ?= escrow:latest
image:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o bin/escrow ./cmd/escrow
	$(GO) run ./scripts/image -binary bin/escrow -out $(IMAGE) -tag $(IMAGE_TAG)
