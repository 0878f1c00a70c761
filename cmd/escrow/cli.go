package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/llmescrow/escrow/internal/csvcell"
	"github.com/llmescrow/escrow/server"
)

// The operator's CLI: each command is one or a few calls to the admin API at ESCROW_URL
// (default http://127.0.0.1:8080) with ESCROW_ADMIN_TOKEN. Exit codes: 0 done, 1 the API
// refused (its message is printed), 2 a usage error, 3 the API could not be reached or is not
// configured.

// Exit codes of the CLI.
const (
	exitRefused     = 1
	exitUsage       = 2
	exitUnreachable = 3
)

// exitError carries an exit code to main.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func usageErr(format string, a ...any) error {
	return &exitError{exitUsage, fmt.Errorf(format, a...)}
}

// The CLI's outside world; tests swap them.
var (
	stdout io.Writer = os.Stdout
	getenv           = os.Getenv
	// progress gets a progress line while a list of several pages is fetched: standard error
	// when it is a terminal, else nothing (so scripts and pipes see only the result).
	progress io.Writer = terminal(os.Stderr)
)

// pageLimit is the page size the CLI asks lists for (the API's largest; tests lower it).
var pageLimit = "1000"

// terminal returns f when it is a character device (a terminal), else nil.
func terminal(f *os.File) io.Writer {
	if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
		return f
	}
	return nil
}

// client talks to the admin API.
type client struct {
	base, token string
	http        *http.Client
}

func newClient() (*client, error) {
	base := strings.TrimRight(getenv("ESCROW_URL"), "/")
	if base == "" {
		base = "http://127.0.0.1:8080"
	}
	token := getenv("ESCROW_ADMIN_TOKEN")
	if token == "" {
		return nil, &exitError{exitUnreachable, errors.New("ESCROW_ADMIN_TOKEN is not set (the proxy's admin token)")}
	}
	return &client{base: base + "/admin/v1", token: token, http: &http.Client{Timeout: 60 * time.Second}}, nil
}

// apiError is the admin API's error body.
type apiError struct {
	Error struct {
		Message string `json:"message"`
		Code    string `json:"code"`
	} `json:"error"`
}

// call sends body (JSON, or nothing when nil) and decodes a 2xx answer into out (when not nil);
// a non-2xx answer is an exitError with the API's code and message.
func (c *client) call(method, path string, body, out any) error {
	raw, _, err := c.raw(method, path, body, "")
	if err != nil || out == nil || len(raw) == 0 {
		return err
	}
	if err := json.Unmarshal(raw, out); err != nil {
		return fmt.Errorf("%s %s: unexpected answer: %w", method, path, err)
	}
	return nil
}

func (c *client) raw(method, path string, body any, accept string) ([]byte, http.Header, error) {
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case []byte: // sent as it is (a price table)
		rd = bytes.NewReader(b)
	default:
		j, err := json.Marshal(body)
		if err != nil {
			return nil, nil, err
		}
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	if err != nil {
		return nil, nil, usageErr("%v", err)
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Content-Type", "application/json")
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	actor := getenv("USER")
	if actor == "" {
		actor = "cli"
	}
	req.Header.Set("X-Escrow-Actor", actor+" (escrow cli)")
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, nil, &exitError{exitUnreachable, fmt.Errorf("cannot reach the admin API at %s (ESCROW_URL): %w", c.base, err)}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, nil, &exitError{exitUnreachable, fmt.Errorf("reading the answer: %w", err)}
	}
	if resp.StatusCode/100 != 2 {
		var e apiError
		if json.Unmarshal(raw, &e) == nil && e.Error.Message != "" {
			return nil, nil, &exitError{exitRefused, fmt.Errorf("%s (%d %s)", e.Error.Message, resp.StatusCode, e.Error.Code)}
		}
		return nil, nil, &exitError{exitRefused, fmt.Errorf("%s %s: HTTP %d", method, path, resp.StatusCode)}
	}
	return raw, resp.Header, nil
}

// page is a list answer.
type page struct {
	Data []map[string]any `json:"data"`
	Next *string          `json:"next"`
}

// all follows a list's cursors to its end, with a progress line from the second page on.
func (c *client) all(path string, query url.Values) ([]map[string]any, error) {
	var out []map[string]any
	for pages := 1; ; pages++ {
		var p page
		if err := c.call(http.MethodGet, path+"?"+query.Encode(), nil, &p); err != nil {
			if pages > 1 && progress != nil {
				fmt.Fprintln(progress)
			}
			return nil, err
		}
		out = append(out, p.Data...)
		if p.Next == nil {
			if pages > 1 && progress != nil {
				fmt.Fprintf(progress, "\r\x1b[Kescrow: %d rows in %d pages\n", len(out), pages)
			}
			return out, nil
		}
		if progress != nil {
			fmt.Fprintf(progress, "\r\x1b[Kescrow: %d rows fetched, page %d …", len(out), pages+1)
		}
		query.Set("cursor", *p.Next)
	}
}

// start parses a subcommand's flags, checks that it got want positional arguments, and makes
// the API client.
func start(fs *flag.FlagSet, args []string, want int, usage string) ([]string, *client, error) {
	pos, err := parse(fs, args)
	if err != nil {
		return nil, nil, err
	}
	if len(pos) != want {
		return nil, nil, usageErr("%s", usage)
	}
	c, err := newClient()
	return pos, c, err
}

// begin parses a subcommand's flags (its positional arguments are checked by the caller) and
// makes the API client.
func begin(fs *flag.FlagSet, args []string) ([]string, *client, error) {
	pos, err := parse(fs, args)
	if err != nil {
		return nil, nil, err
	}
	c, err := newClient()
	return pos, c, err
}

// setGiven sets the query parameters whose flags were given (non-empty).
func setGiven(q url.Values, flags map[string]string) {
	for k, v := range flags {
		if v != "" {
			q.Set(k, v)
		}
	}
}

// timeRange adds --from and --to to fs; the function it returns puts the given ones into a query.
func timeRange(fs *flag.FlagSet) func(q url.Values) {
	from := fs.String("from", "", "from this time (RFC 3339) or date (YYYY-MM-DD), inclusive")
	to := fs.String("to", "", "to this time or date, exclusive")
	return func(q url.Values) { setGiven(q, map[string]string{"from": *from, "to": *to}) }
}

// parse parses flags wherever they are among the arguments and returns the positional ones.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	fs.SetOutput(io.Discard)
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, usageErr("%s: %v", fs.Name(), err)
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// output prints v as JSON (--json) or rows as a table (or CSV with --csv).
type output struct{ json, csv bool }

func (o *output) flags(fs *flag.FlagSet) {
	fs.BoolVar(&o.json, "json", false, "print the API's JSON")
	fs.BoolVar(&o.csv, "csv", false, "print CSV")
}

func (o output) print(v any, cols []string, rows []map[string]any) error {
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetEscapeHTML(false)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	if o.csv {
		w := csv.NewWriter(stdout)
		_ = w.Write(cols)
		for _, r := range rows {
			_ = w.Write(csvcell.Row(cells(cols, r)))
		}
		w.Flush()
		return w.Error()
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.ToUpper(strings.Join(cols, "\t")))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(cells(cols, r), "\t"))
	}
	return tw.Flush()
}

func cells(cols []string, r map[string]any) []string {
	out := make([]string, len(cols))
	for i, c := range cols {
		out[i] = cell(r[c])
	}
	return out
}

func cell(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		return x
	case float64: // JSON numbers of the API are integers within ±10^14: exact in a float64
		return strconv.FormatFloat(x, 'f', -1, 64)
	default:
		b, _ := json.Marshal(x)
		return string(b)
	}
}

func one(v map[string]any) []map[string]any { return []map[string]any{v} }

// newFlags is a subcommand's flag set with the output flags (--json, --csv) on it.
func newFlags(name string) (*flag.FlagSet, *output) {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	o := &output{}
	o.flags(fs)
	return fs, o
}

// show sends one call and prints its answer, one object, with cols.
func (c *client) show(o *output, method, path string, body any, cols []string) error {
	var res map[string]any
	if err := c.call(method, path, body, &res); err != nil {
		return err
	}
	return o.print(res, cols, one(res))
}

// list fetches a whole list (every page) and prints it with cols.
func (c *client) list(o *output, path string, query url.Values, cols []string) error {
	rows, err := c.all(path, query)
	if err != nil {
		return err
	}
	return o.print(rows, cols, rows)
}

// do sends one call whose answer says nothing worth printing, then prints said.
func (c *client) do(method, path string, body any, said string) error {
	if err := c.call(method, path, body, nil); err != nil {
		return err
	}
	fmt.Fprintln(stdout, said)
	return nil
}

// firstPage fetches one page of a list (the API answers it whole) and prints it with cols.
func (c *client) firstPage(o *output, path string, cols []string) error {
	var p page
	if err := c.call(http.MethodGet, path, nil, &p); err != nil {
		return err
	}
	return o.print(p, cols, p.Data)
}

// cmdOrgs: escrow orgs [list] | create ID [--name N] | show ID | rename ID NAME | threshold ID N|none
// (the balance under which a balance.low webhook fires).
func cmdOrgs(args []string) error {
	fs, o := newFlags("orgs")
	name := fs.String("name", "", "display name (create)")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	cols := []string{"id", "name", "ledger_balance", "available", "held", "created_at"}
	sub := "list"
	if len(pos) > 0 {
		sub, pos = pos[0], pos[1:]
	}
	switch {
	case sub == "list" && len(pos) == 0:
		return c.list(o, "/orgs", url.Values{"limit": {pageLimit}}, cols)
	case sub == "create" && len(pos) == 1:
		return c.show(o, http.MethodPost, "/orgs", map[string]string{"id": pos[0], "name": *name}, []string{"id", "name"})
	case sub == "show" && len(pos) == 1:
		return c.show(o, http.MethodGet, "/orgs/"+url.PathEscape(pos[0]), nil, cols)
	case sub == "rename" && len(pos) == 2:
		return c.show(o, http.MethodPatch, "/orgs/"+url.PathEscape(pos[0]), map[string]string{"name": pos[1]}, cols)
	case sub == "threshold" && len(pos) == 2:
		var v any // "none" clears it
		if pos[1] != "none" {
			n, perr := strconv.ParseInt(pos[1], 10, 64)
			if perr != nil {
				return usageErr("the low-balance threshold is a whole number of micro-units or none, not %q", pos[1])
			}
			v = n
		}
		return c.show(o, http.MethodPatch, "/orgs/"+url.PathEscape(pos[0]), map[string]any{"low_balance_threshold": v}, []string{"id", "low_balance_threshold"})
	default:
		return usageErr("usage: escrow orgs [list] | create ID [--name NAME] | show ID | rename ID NAME | threshold ID MICRO_UNITS|none  [--json|--csv]")
	}
}

// cmdCredit: escrow credit ORG AMOUNT --ref REF (AMOUNT in micro-units).
func cmdCredit(args []string) error {
	fs, o := newFlags("credit")
	ref := fs.String("ref", "", "payment reference (required; the same reference again is the same credit)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 || *ref == "" {
		return usageErr("usage: escrow credit ORG AMOUNT --ref REFERENCE  (AMOUNT in micro-units)")
	}
	amount, err := strconv.ParseInt(pos[1], 10, 64)
	if err != nil || amount <= 0 {
		return usageErr("AMOUNT must be a positive whole number of micro-units, not %q", pos[1])
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	return c.show(o, http.MethodPost, "/orgs/"+url.PathEscape(pos[0])+"/credits", map[string]any{"amount": amount, "reference": *ref},
		[]string{"org", "seq", "delta", "reference", "created_at"})
}

// cmdKeys: escrow keys ORG | create ORG [--name N] | rename ID NAME | revoke ID.
func cmdKeys(args []string) error {
	fs, o := newFlags("keys")
	name := fs.String("name", "", "display name (create)")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) == 1:
		return c.list(o, "/orgs/"+url.PathEscape(pos[0])+"/keys", url.Values{"limit": {pageLimit}},
			[]string{"id", "name", "project", "created_at", "last_used_at", "revoked_at"})
	case len(pos) == 2 && pos[0] == "create":
		return c.show(o, http.MethodPost, "/orgs/"+url.PathEscape(pos[1])+"/keys", map[string]string{"name": *name}, []string{"id", "name", "key"})
	case len(pos) == 3 && pos[0] == "rename":
		return c.show(o, http.MethodPatch, "/keys/"+url.PathEscape(pos[1]), map[string]string{"name": pos[2]}, []string{"id", "name"})
	case len(pos) == 2 && pos[0] == "revoke":
		return c.do(http.MethodDelete, "/keys/"+url.PathEscape(pos[1]), nil, "revoked "+pos[1])
	default:
		return usageErr("usage: escrow keys ORG | create ORG [--name NAME] | rename KEY_ID NAME | revoke KEY_ID  [--json|--csv]")
	}
}

// cmdUsage: escrow usage ORG [--by day|model|key] [--from T] [--to T] [--csv|--json].
func cmdUsage(args []string) error {
	fs, o := newFlags("usage")
	by := fs.String("by", "day", "group by day, model or key")
	inRange := timeRange(fs)
	pos, c, err := start(fs, args, 1, "usage: escrow usage ORG [--by day|model|key] [--from T] [--to T] [--json|--csv]")
	if err != nil {
		return err
	}
	q := url.Values{"group_by": {*by}}
	inRange(q)
	path := "/orgs/" + url.PathEscape(pos[0]) + "/usage?" + q.Encode()
	if o.csv { // the API's own CSV, as exported for reconciliation
		raw, _, err := c.raw(http.MethodGet, path, nil, "text/csv")
		if err != nil {
			return err
		}
		_, err = stdout.Write(raw)
		return err
	}
	var p page
	if err := c.call(http.MethodGet, path, nil, &p); err != nil {
		return err
	}
	for _, r := range p.Data {
		r[*by] = r["group"]
	}
	return o.print(p, []string{*by, "requests", "cost", "prompt_tokens", "cached_tokens", "completion_tokens"}, p.Data)
}

// cmdModels: escrow models | show M | set M [--input D] [--cached-input D] [--output D]
// [--cache-write-input D] [--cache-write-1h-input D] [--max-input-tokens N] [--max-output-tokens N] [--default-hold N] |
// import FILE [--dry-run] [--provider P] | delete M. Prices are decimals in currency units per 1M
// tokens ("0.15"), sent as text and converted exactly by the API (a cached or cache-write price
// never set is billed at its default, which show prints: the input price, 2× it for 1-hour cache
// writes); an import sends the file
// (LiteLLM's JSON or a CSV) as it is (importModels).
func cmdModels(args []string) error {
	fs, o := newFlags("models")
	setBody := modelFlags(fs)
	dryRun := fs.Bool("dry-run", false, "import: print what would change and write nothing")
	provider := fs.String("provider", "", "import: only these litellm_provider values (comma-separated)")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	cols := []string{"model", "input_price", "cached_input_price", "output_price", "max_input_tokens", "max_output_tokens", "max_cost", "default_hold", "cache_write_input_price",
		"cache_write_1h_input_price"}
	switch {
	case len(pos) == 0:
		return c.firstPage(o, "/models", cols)
	case len(pos) == 2 && pos[0] == "show":
		return c.show(o, http.MethodGet, "/models/"+url.PathEscape(pos[1]), nil, cols)
	case len(pos) == 2 && pos[0] == "set":
		body, err := setBody(pos[1])
		if err != nil {
			return err
		}
		return c.show(o, http.MethodPatch, "/models/"+url.PathEscape(pos[1]), body, cols)
	case len(pos) == 2 && pos[0] == "import":
		return importModels(c, *o, pos[1], *dryRun, *provider)
	case len(pos) == 2 && pos[0] == "delete":
		return c.do(http.MethodDelete, "/models/"+url.PathEscape(pos[1]), nil, "deleted "+pos[1])
	default:
		return usageErr("usage: escrow models | show MODEL | set MODEL [--input D] [--cached-input D] [--output D] [--cache-write-input D] [--cache-write-1h-input D] [--max-input-tokens N] [--max-output-tokens N] [--default-hold N] | import FILE [--dry-run] [--provider P,…] | delete MODEL  [--json|--csv]")
	}
}

// modelFlags adds the flags of `escrow models set` to fs; the function it returns makes the
// PATCH body of model from the given ones (a usage error when none is given or one is not a
// whole number).
func modelFlags(fs *flag.FlagSet) func(model string) (map[string]any, error) {
	var prices [5]string
	fs.StringVar(&prices[0], "input", "", "input price per 1M tokens (decimal, currency units)")
	fs.StringVar(&prices[1], "cached-input", "", "cached input price per 1M tokens (default: the input price)")
	fs.StringVar(&prices[2], "output", "", "output price per 1M tokens")
	fs.StringVar(&prices[3], "cache-write-input", "", "prompt-cache write price per 1M tokens, 5-minute cache (Anthropic; default: the input price)")
	fs.StringVar(&prices[4], "cache-write-1h-input", "", "prompt-cache write price per 1M tokens, 1-hour cache (Anthropic; default: 2× the input price)")
	var ints [3]string
	fs.StringVar(&ints[0], "max-input-tokens", "", "context window")
	fs.StringVar(&ints[1], "max-output-tokens", "", "largest output")
	fs.StringVar(&ints[2], "default-hold", "", "hold (micro-units) when nothing better is known")
	return func(model string) (map[string]any, error) {
		body := map[string]any{}
		for i, k := range []string{"input_per_1m", "cached_input_per_1m", "output_per_1m", "cache_write_input_per_1m", "cache_write_1h_input_per_1m"} {
			if prices[i] != "" {
				body[k] = prices[i]
			}
		}
		for i, k := range []string{"max_input_tokens", "max_output_tokens", "default_hold"} {
			if ints[i] != "" {
				n, err := strconv.ParseInt(ints[i], 10, 64)
				if err != nil {
					return nil, usageErr("--%s must be a whole number, not %q", strings.ReplaceAll(k, "_", "-"), ints[i])
				}
				body[k] = n
			}
		}
		if len(body) == 0 {
			return nil, usageErr("escrow models set %s: nothing to set (--input, --output, …)", model)
		}
		return body, nil
	}
}

// cmdRequest: escrow request ID — one request by its x-request-id.
func cmdRequest(args []string) error {
	fs, o := newFlags("request")
	pos, c, err := start(fs, args, 1, "usage: escrow request REQUEST_ID [--json|--csv]")
	if err != nil {
		return err
	}
	return c.show(o, http.MethodGet, "/requests/"+url.PathEscape(pos[0]), nil,
		[]string{"id", "org", "key_id", "model", "status", "cost", "hold_amount", "estimated", "usage", "created_at"})
}

// cmdEntries: escrow entries ORG [--kind K] [--from T] [--to T] — the org's ledger, newest first.
func cmdEntries(args []string) error {
	fs, o := newFlags("entries")
	kind := fs.String("kind", "", "charge, credit or adjust (default: all)")
	inRange := timeRange(fs)
	pos, c, err := start(fs, args, 1, "usage: escrow entries ORG [--kind charge|credit|adjust] [--from T] [--to T] [--json|--csv]")
	if err != nil {
		return err
	}
	q := url.Values{"limit": {pageLimit}}
	setGiven(q, map[string]string{"kind": *kind})
	inRange(q)
	rows, err := c.all("/orgs/"+url.PathEscape(pos[0])+"/entries", q)
	if err != nil {
		return err
	}
	for _, r := range rows { // a charge's request, flattened for the table and CSV
		if req, ok := r["request"].(map[string]any); ok {
			r["request_id"], r["model"], r["cost"], r["hold_amount"] = req["id"], req["model"], req["cost"], req["hold_amount"]
		}
	}
	return o.print(rows, []string{"seq", "kind", "delta", "reference", "request_id", "model", "cost", "hold_amount", "created_at"}, rows)
}

// cmdAudit: escrow audit — every admin write, newest first.
func cmdAudit(args []string) error {
	fs, o := newFlags("audit")
	_, c, err := start(fs, args, 0, "usage: escrow audit [--json|--csv]")
	if err != nil {
		return err
	}
	return c.list(o, "/audit", url.Values{"limit": {pageLimit}}, []string{"id", "at", "actor", "action", "target", "status"})
}

// cmdReconcile: escrow reconcile ORG — the org's hot balance against the ledger; a drift is
// repaired (the hot balance is dropped and reseeds on the next request).
func cmdReconcile(args []string) error {
	fs, o := newFlags("reconcile")
	pos, c, err := start(fs, args, 1, "usage: escrow reconcile ORG [--json|--csv]")
	if err != nil {
		return err
	}
	return c.show(o, http.MethodPost, "/orgs/"+url.PathEscape(pos[0])+"/reconcile", nil,
		[]string{"org", "warm", "hot", "expected", "drift", "repaired", "caught_up"})
}

// cmdEpoch: escrow epoch [raise] — the ledger's epoch; raise starts a new one, after restoring
// the ledger from a backup (every hot balance of the old timeline is then reseeded).
func cmdEpoch(args []string) error {
	fs, o := newFlags("epoch")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	method := http.MethodGet
	switch {
	case len(pos) == 0:
	case len(pos) == 1 && pos[0] == "raise":
		method = http.MethodPost
	default:
		return usageErr("usage: escrow epoch [raise]  [--json|--csv]")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	return c.show(o, method, "/ledger/epoch", nil, []string{"generation", "id"})
}

// cmdMigrate: escrow migrate [--database-url URL] — applies the ledger's migrations, then exits;
// for deployments that run the proxies with ESCROW_MIGRATE=false.
func cmdMigrate(args []string) error {
	fs := flag.NewFlagSet("migrate", flag.ContinueOnError)
	dsn := fs.String("database-url", getenv("DATABASE_URL"), "the ledger's Postgres (default: DATABASE_URL)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 || *dsn == "" {
		return usageErr("usage: escrow migrate [--database-url URL]  (or set DATABASE_URL)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	applied, err := server.Migrate(ctx, *dsn)
	if err != nil {
		return &exitError{exitUnreachable, err}
	}
	if len(applied) == 0 {
		fmt.Fprintln(stdout, "the database is up to date")
		return nil
	}
	fmt.Fprintln(stdout, "applied migrations", strings.Trim(fmt.Sprint(applied), "[]"))
	return nil
}

// cmdTop: escrow top [--from T] [--to T] [--limit N] — the orgs that spent the most.
func cmdTop(args []string) error {
	fs, o := newFlags("top")
	inRange := timeRange(fs)
	limit := fs.String("limit", "10", "how many orgs (at most 1000)")
	_, c, err := start(fs, args, 0, "usage: escrow top [--from T] [--to T] [--limit N] [--json|--csv]")
	if err != nil {
		return err
	}
	q := url.Values{"limit": {*limit}}
	inRange(q)
	return c.firstPage(o, "/usage/top?"+q.Encode(), []string{"org", "requests", "cost", "prompt_tokens", "cached_tokens", "completion_tokens"})
}

// cmdWebhooks: escrow webhooks | create URL --events E1,E2 | delete ID | deliveries ID.
func cmdWebhooks(args []string) error {
	fs, o := newFlags("webhooks")
	events := fs.String("events", "", "comma-separated event types (create): balance.low, credit.received, key.revoked, limit.crossed")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	cols := []string{"id", "url", "events", "created_at"}
	switch {
	case len(pos) == 0:
		return c.list(o, "/webhooks", url.Values{"limit": {pageLimit}}, cols)
	case len(pos) == 2 && pos[0] == "create" && *events != "":
		return c.show(o, http.MethodPost, "/webhooks", map[string]any{"url": pos[1], "events": strings.Split(*events, ",")}, append(cols, "secret"))
	case len(pos) == 2 && pos[0] == "delete":
		return c.do(http.MethodDelete, "/webhooks/"+url.PathEscape(pos[1]), nil, "deleted "+pos[1])
	case len(pos) == 2 && pos[0] == "deliveries":
		return c.list(o, "/webhooks/"+url.PathEscape(pos[1])+"/deliveries", url.Values{"limit": {pageLimit}},
			[]string{"id", "event_type", "org", "status", "attempts", "last_status", "last_error", "next_attempt_at", "created_at"})
	default:
		return usageErr("usage: escrow webhooks | create URL --events TYPE[,TYPE…] | delete ID | deliveries ID  [--json|--csv]")
	}
}

// importReport is the admin API's answer to an import (accounting.ImportReport).
type importReport struct {
	DryRun    bool                                `json:"dry_run"`
	New       []map[string]any                    `json:"new"`
	Changed   []struct{ Old, New map[string]any } `json:"changed"`
	Unchanged []string                            `json:"unchanged"`
	Skipped   []struct{ Model, Reason string }    `json:"skipped"`
	RoundedUp []string                            `json:"rounded_up"`
}

// defaultPrice reports whether field f of an imported model (as the import report shows it,
// defaults filled in) is a cache-write price at its default.
func defaultPrice(m map[string]any, f string) bool {
	in, _ := m["input_price"].(float64)
	v, ok := m[f].(float64)
	switch f {
	case "cache_write_input_price":
		return ok && v == in
	case "cache_write_1h_input_price":
		return ok && v == 2*in // pricing.CacheWrite1hMultiplier (the CLI imports server only)
	}
	return false
}

// importModels sends a price table to POST /models/import and prints the diff: each new model
// with its prices, each changed field as old → new, the count of unchanged models, and the
// skipped entries counted by reason. A cache-write price at its default (the input price, 2× it
// for 1-hour writes: pricing.Prices.WithDefaults) is left out of the lines.
func importModels(c *client, o output, file string, dryRun bool, provider string) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return usageErr("escrow models import: %v", err)
	}
	q := url.Values{}
	if dryRun {
		q.Set("dry_run", "1")
	}
	setGiven(q, map[string]string{"provider": provider})
	raw, _, err := c.raw(http.MethodPost, "/models/import?"+q.Encode(), b, "")
	if err != nil {
		return err
	}
	if o.json {
		_, err := stdout.Write(raw)
		return err
	}
	var r importReport
	if err := json.Unmarshal(raw, &r); err != nil {
		return fmt.Errorf("escrow models import: unexpected answer: %w", err)
	}
	fields := []string{"input_price", "cached_input_price", "output_price", "max_input_tokens", "max_output_tokens", "cache_write_input_price",
		"cache_write_1h_input_price"}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if r.DryRun {
		fmt.Fprintln(tw, "dry run: nothing written")
	}
	for _, m := range r.New {
		var parts []string
		for _, f := range fields {
			if defaultPrice(m, f) {
				continue // a cache-write price the table left out: its default
			}
			parts = append(parts, f+" "+cell(m[f]))
		}
		fmt.Fprintf(tw, "new\t%s\t%s\n", cell(m["model"]), strings.Join(parts, ", "))
	}
	for _, ch := range r.Changed {
		var parts []string
		for _, f := range fields {
			if a, b := cell(ch.Old[f]), cell(ch.New[f]); a != b && !(defaultPrice(ch.Old, f) && defaultPrice(ch.New, f)) {
				parts = append(parts, f+" "+a+" → "+b)
			}
		}
		fmt.Fprintf(tw, "changed\t%s\t%s\n", cell(ch.New["model"]), strings.Join(parts, ", "))
	}
	for _, ru := range r.RoundedUp {
		fmt.Fprintf(tw, "rounded up\t%s\t(not a whole micro-unit per 1M tokens)\n", ru)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	reasons := map[string]int{}
	var order []string
	for _, s := range r.Skipped {
		if reasons[s.Reason] == 0 {
			order = append(order, s.Reason)
		}
		reasons[s.Reason]++
	}
	for _, why := range order {
		fmt.Fprintf(stdout, "skipped %d: %s\n", reasons[why], why)
	}
	verb := "imported"
	if r.DryRun {
		verb = "would import"
	}
	fmt.Fprintf(stdout, "%s: %d new, %d changed, %d unchanged, %d skipped\n", verb, len(r.New), len(r.Changed), len(r.Unchanged), len(r.Skipped))
	return nil
}

// cmdLimits: escrow limits ORG | create ORG --window W --cap N [--key ID | --project P] |
// set-cap ORG LIMIT_ID N | delete ORG LIMIT_ID.
func cmdLimits(args []string) error {
	fs, o := newFlags("limits")
	window := fs.String("window", "", "lifetime, hour, day, week or month (create)")
	capArg := fs.String("cap", "", "the cap in micro-units (create)")
	key := fs.String("key", "", "a key's limit: the key id (create)")
	project := fs.String("project", "", "a project's limit: the project id (create)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	usage := usageErr("usage: escrow limits ORG | create ORG --window W --cap N [--key ID|--project P] | set-cap ORG LIMIT_ID N | delete ORG LIMIT_ID  [--json|--csv]")
	c, err := newClient()
	if err != nil {
		return err
	}
	created := []string{"id", "scope", "scope_id", "window", "cap"}
	switch {
	case len(pos) == 1:
		return c.list(o, "/orgs/"+url.PathEscape(pos[0])+"/limits", url.Values{}, []string{"id", "scope", "scope_id", "window", "cap", "used", "held", "resets_at"})
	case len(pos) == 2 && pos[0] == "create":
		n, err := strconv.ParseInt(*capArg, 10, 64)
		if err != nil || *window == "" || (*key != "" && *project != "") {
			return usage
		}
		body := map[string]any{"scope": "org", "window": *window, "cap": n}
		switch {
		case *key != "":
			body["scope"], body["scope_id"] = "key", *key
		case *project != "":
			body["scope"], body["scope_id"] = "project", *project
		}
		return c.show(o, http.MethodPost, "/orgs/"+url.PathEscape(pos[1])+"/limits", body, created)
	case len(pos) == 4 && pos[0] == "set-cap":
		n, err := strconv.ParseInt(pos[3], 10, 64)
		if err != nil {
			return usageErr("the cap must be a whole number of micro-units, not %q", pos[3])
		}
		return c.show(o, http.MethodPatch, "/orgs/"+url.PathEscape(pos[1])+"/limits/"+url.PathEscape(pos[2]), map[string]any{"cap": n}, created)
	case len(pos) == 3 && pos[0] == "delete":
		return c.do(http.MethodDelete, "/orgs/"+url.PathEscape(pos[1])+"/limits/"+url.PathEscape(pos[2]), nil, "deleted "+pos[2])
	default:
		return usage
	}
}

// cmdProjects: escrow projects create ORG ID | add-key KEY_ID PROJECT | remove-key KEY_ID.
func cmdProjects(args []string) error {
	fs := flag.NewFlagSet("projects", flag.ContinueOnError)
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) == 3 && pos[0] == "create":
		return c.do(http.MethodPost, "/orgs/"+url.PathEscape(pos[1])+"/projects", map[string]string{"id": pos[2]}, "ok")
	case len(pos) == 3 && pos[0] == "add-key":
		return c.do(http.MethodPut, "/keys/"+url.PathEscape(pos[1])+"/project", map[string]any{"project": pos[2]}, "ok")
	case len(pos) == 2 && pos[0] == "remove-key":
		return c.do(http.MethodPut, "/keys/"+url.PathEscape(pos[1])+"/project", map[string]any{"project": nil}, "ok")
	default:
		return usageErr("usage: escrow projects create ORG PROJECT | add-key KEY_ID PROJECT | remove-key KEY_ID")
	}
}

// freezeCmd: escrow freeze|unfreeze ORG [--project P] | --key KEY_ID.
func freezeCmd(name, path string) func(args []string) error {
	return func(args []string) error {
		fs := flag.NewFlagSet(name, flag.ContinueOnError)
		project := fs.String("project", "", "the org's project to "+name)
		key := fs.String("key", "", "the key to "+name+" (no ORG then)")
		pos, err := parse(fs, args)
		if err != nil {
			return err
		}
		var target string
		switch {
		case *key != "" && len(pos) == 0 && *project == "":
			target = "/keys/" + url.PathEscape(*key) + "/" + path
		case *key == "" && len(pos) == 1 && *project != "":
			target = "/orgs/" + url.PathEscape(pos[0]) + "/projects/" + url.PathEscape(*project) + "/" + path
		case *key == "" && len(pos) == 1:
			target = "/orgs/" + url.PathEscape(pos[0]) + "/" + path
		default:
			return usageErr("usage: escrow %s ORG [--project P] | escrow %s --key KEY_ID", name, name)
		}
		c, err := newClient()
		if err != nil {
			return err
		}
		return c.do(http.MethodPost, target, nil, map[string]string{"freeze": "frozen", "unfreeze": "unfrozen"}[name])
	}
}
