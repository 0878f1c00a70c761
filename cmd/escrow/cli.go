package main

import (
	"bytes"
	"context"
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

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
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

// fetch sends body (JSON, or nothing when nil) and decodes a 2xx answer into a T; raw is the
// answer as it came (what --json prints). A non-2xx answer is an exitError with the API's code
// and message.
func fetch[T any](c *client, method, path string, body any) (v T, raw json.RawMessage, err error) {
	raw, _, err = c.raw(method, path, body, "")
	if err != nil || len(raw) == 0 {
		return v, raw, err
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return v, raw, fmt.Errorf("%s %s: unexpected answer: %w", method, path, err)
	}
	return v, raw, nil
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

// all follows a list's cursors to its end, with a progress line from the second page on; it
// returns the rows as they came (what --json prints) and decoded.
func all[T any](c *client, path string, query url.Values) ([]json.RawMessage, []T, error) {
	var raws []json.RawMessage
	for pages := 1; ; pages++ {
		p, _, err := fetch[admin.Page[json.RawMessage]](c, http.MethodGet, path+"?"+query.Encode(), nil)
		if err != nil {
			if pages > 1 && progress != nil {
				fmt.Fprintln(progress)
			}
			return nil, nil, err
		}
		raws = append(raws, p.Data...)
		if p.Next == nil {
			if pages > 1 && progress != nil {
				fmt.Fprintf(progress, "\r\x1b[Kescrow: %d rows in %d pages\n", len(raws), pages)
			}
			rows, err := decodeAll[T](raws)
			if err != nil {
				return nil, nil, fmt.Errorf("GET %s: unexpected answer: %w", path, err)
			}
			return raws, rows, nil
		}
		if progress != nil {
			fmt.Fprintf(progress, "\r\x1b[Kescrow: %d rows fetched, page %d …", len(raws), pages+1)
		}
		query.Set("cursor", *p.Next)
	}
}

// decodeAll decodes each of raws into a T.
func decodeAll[T any](raws []json.RawMessage) ([]T, error) {
	out := make([]T, len(raws))
	for i, r := range raws {
		if err := json.Unmarshal(r, &out[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
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

// newFlags is a subcommand's flag set with the output flags (--json, --csv) on it.
func newFlags(name string) (*flag.FlagSet, *output) {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	o := &output{}
	o.flags(fs)
	return fs, o
}

// show sends one call and prints its answer, one T, with t.
func show[T any](c *client, o *output, method, path string, body any, t table[T]) error {
	v, raw, err := fetch[T](c, method, path, body)
	if err != nil {
		return err
	}
	return t.print(o, raw, []T{v})
}

// list fetches a whole list (every page) and prints it with t.
func list[T any](c *client, o *output, path string, query url.Values, t table[T]) error {
	raws, rows, err := all[T](c, path, query)
	if err != nil {
		return err
	}
	return t.print(o, raws, rows)
}

// do sends one call whose answer says nothing worth printing, then prints said.
func (c *client) do(method, path string, body any, said string) error {
	if _, _, err := c.raw(method, path, body, ""); err != nil {
		return err
	}
	fmt.Fprintln(stdout, said)
	return nil
}

// firstPage fetches one page of a list (the API answers it whole) and prints it with t.
func firstPage[T any](c *client, o *output, path string, t table[T]) error {
	p, raw, err := fetch[admin.Page[T]](c, http.MethodGet, path, nil)
	if err != nil {
		return err
	}
	return t.print(o, raw, p.Data)
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
	sub := "list"
	if len(pos) > 0 {
		sub, pos = pos[0], pos[1:]
	}
	switch {
	case sub == "list" && len(pos) == 0:
		return list(c, o, "/orgs", url.Values{"limit": {pageLimit}}, orgTable)
	case sub == "create" && len(pos) == 1:
		return show(c, o, http.MethodPost, "/orgs", map[string]string{"id": pos[0], "name": *name}, namedTable)
	case sub == "show" && len(pos) == 1:
		return show(c, o, http.MethodGet, "/orgs/"+url.PathEscape(pos[0]), nil, orgTable)
	case sub == "rename" && len(pos) == 2:
		return show(c, o, http.MethodPatch, "/orgs/"+url.PathEscape(pos[0]), map[string]string{"name": pos[1]}, orgTable)
	case sub == "threshold" && len(pos) == 2:
		var v any // "none" clears it
		if pos[1] != "none" {
			n, perr := strconv.ParseInt(pos[1], 10, 64)
			if perr != nil {
				return usageErr("the low-balance threshold is a whole number of micro-units or none, not %q", pos[1])
			}
			v = n
		}
		return show(c, o, http.MethodPatch, "/orgs/"+url.PathEscape(pos[0]), map[string]any{"low_balance_threshold": v}, thresholdTable)
	default:
		return usageErr("usage: escrow orgs [list] | create ID [--name NAME] | show ID | rename ID NAME | threshold ID MICRO_UNITS|none  [--json|--csv]")
	}
}

// cmdCredit: escrow credit ORG AMOUNT --ref REF [--expires-at RFC3339] [--priority N] (AMOUNT in
// micro-units; with an expiry or a priority the credit is a grant with those terms:
// docs/grants.md).
func cmdCredit(args []string) error {
	fs, o := newFlags("credit")
	ref := fs.String("ref", "", "payment reference (required; the same reference again is the same credit)")
	expires := fs.String("expires-at", "", "when the credit's unspent rest expires (RFC 3339; default: never)")
	priority := fs.Int("priority", -1, "spending priority, lower first: 0 promotional … 100 paid (default 100)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 || *ref == "" {
		return usageErr("usage: escrow credit ORG AMOUNT --ref REFERENCE [--expires-at RFC3339] [--priority N]  (AMOUNT in micro-units)")
	}
	amount, err := strconv.ParseInt(pos[1], 10, 64)
	if err != nil || amount <= 0 {
		return usageErr("AMOUNT must be a positive whole number of micro-units, not %q", pos[1])
	}
	body := map[string]any{"amount": amount, "reference": *ref}
	if *expires != "" {
		t, err := time.Parse(time.RFC3339, *expires)
		if err != nil {
			return usageErr("--expires-at must be an RFC 3339 time, not %q", *expires)
		}
		body["expires_at"] = t
	}
	if *priority >= 0 {
		body["priority"] = *priority
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	return show(c, o, http.MethodPost, "/orgs/"+url.PathEscape(pos[0])+"/credits", body, creditTable)
}

// cmdGrants: escrow grants ORG, the org's credit grants in spending order.
func cmdGrants(args []string) error {
	fs, o := newFlags("grants")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageErr("usage: escrow grants ORG  [--json|--csv]")
	}
	return firstPage(c, o, "/orgs/"+url.PathEscape(pos[0])+"/grants", grantTable)
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
		return list(c, o, "/orgs/"+url.PathEscape(pos[0])+"/keys", url.Values{"limit": {pageLimit}}, keyTable)
	case len(pos) == 2 && pos[0] == "create":
		return show(c, o, http.MethodPost, "/orgs/"+url.PathEscape(pos[1])+"/keys", map[string]string{"name": *name}, newKeyTable)
	case len(pos) == 3 && pos[0] == "rename":
		return show(c, o, http.MethodPatch, "/keys/"+url.PathEscape(pos[1]), map[string]string{"name": pos[2]}, namedTable)
	case len(pos) == 2 && pos[0] == "revoke":
		return c.do(http.MethodDelete, "/keys/"+url.PathEscape(pos[1]), nil, "revoked "+pos[1])
	case (len(pos) == 2 || len(pos) == 3) && pos[0] == "models":
		return keyModels(c, o, pos[1:])
	default:
		return usageErr("usage: escrow keys ORG | create ORG [--name NAME] | rename KEY_ID NAME | revoke KEY_ID | models KEY_ID [MODEL,PREFIX*,…]  [--json|--csv]")
	}
}

// cmdUsage: escrow usage ORG [--by day|model|key|end_user] [--from T] [--to T] [--csv|--json].
func cmdUsage(args []string) error {
	fs, o := newFlags("usage")
	by := fs.String("by", "day", "group by day, model, key or end_user")
	inRange := timeRange(fs)
	pos, c, err := start(fs, args, 1, "usage: escrow usage ORG [--by day|model|key|end_user] [--from T] [--to T] [--json|--csv]")
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
	p, raw, err := fetch[admin.Page[ledger.UsageRow]](c, http.MethodGet, path, nil)
	if err != nil {
		return err
	}
	var v any = raw
	if o.json {
		if v, err = groupNamed(raw, *by, p.Data); err != nil {
			return err
		}
	}
	return usageTable(*by).print(o, v, p.Data)
}

// groupNamed is the usage page raw (of rows) with each row's group also under the grouping's
// name ("day": "2024-05-01"), as the table names its first column: what usage --json prints.
func groupNamed(raw json.RawMessage, by string, rows []ledger.UsageRow) (admin.Page[json.RawMessage], error) {
	var p admin.Page[json.RawMessage]
	err := json.Unmarshal(raw, &p)
	for i := range p.Data {
		if err == nil {
			p.Data[i], err = withFields(p.Data[i], map[string]string{by: rows[i].Group})
		}
	}
	return p, err
}

// cmdModels: escrow models | show M | set M [--input D] [--cached-input D] [--output D]
// [--cache-write-input D] [--cache-write-1h-input D] [--price CLASS=D]… [--max-input-tokens N] [--max-output-tokens N] [--default-hold N] |
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
	switch {
	case len(pos) == 0:
		p, raw, err := fetch[admin.Page[ledger.Model]](c, http.MethodGet, "/models", nil)
		if err != nil {
			return err
		}
		return modelTable(p.Data).print(o, raw, p.Data)
	case len(pos) == 2 && pos[0] == "show":
		return showModel(c, o, http.MethodGet, pos[1], nil)
	case len(pos) == 2 && pos[0] == "set":
		body, err := setBody(pos[1])
		if err != nil {
			return err
		}
		return showModel(c, o, http.MethodPatch, pos[1], body)
	case len(pos) == 2 && pos[0] == "import":
		return importModels(c, *o, pos[1], *dryRun, *provider)
	case len(pos) == 2 && pos[0] == "delete":
		return c.do(http.MethodDelete, "/models/"+url.PathEscape(pos[1]), nil, "deleted "+pos[1])
	default:
		return usageErr("usage: escrow models | show MODEL | set MODEL [--input D] [--cached-input D] [--output D] [--cache-write-input D] [--cache-write-1h-input D] [--price CLASS=D]… [--max-input-tokens N] [--max-output-tokens N] [--default-hold N] | import FILE [--dry-run] [--provider P,…] | delete MODEL  [--json|--csv]")
	}
}

// showModel sends one call about a model and prints the model it answers.
func showModel(c *client, o *output, method, model string, body any) error {
	m, raw, err := fetch[ledger.Model](c, method, "/models/"+url.PathEscape(model), body)
	if err != nil {
		return err
	}
	return modelTable([]ledger.Model{m}).print(o, raw, []ledger.Model{m})
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
	var classPrices []string
	fs.Func("price", "CLASS=DECIMAL: the price of any price class (escrow price-classes lists them), per 1M tokens or characters, or per item or second; repeatable", func(v string) error {
		classPrices = append(classPrices, v)
		return nil
	})
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
		for _, cp := range classPrices {
			name, dec, ok := strings.Cut(cp, "=")
			info, known := pricing.Lookup(pricing.Class(name))
			if !ok || !known {
				return nil, usageErr("--price %q: want CLASS=DECIMAL with a class escrow price-classes lists", cp)
			}
			suffix := "_per_unit"
			if info.Unit == pricing.PerMTokens || info.Unit == pricing.PerMCharacters {
				suffix = "_per_1m"
			}
			body[name+suffix] = dec
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

// cmdPriceClasses: escrow price-classes — the registry of price classes.
func cmdPriceClasses(args []string) error {
	fs, o := newFlags("price-classes")
	_, c, err := start(fs, args, 0, "usage: escrow price-classes [--json|--csv]")
	if err != nil {
		return err
	}
	return firstPage(c, o, "/price-classes", priceClassTable)
}

// cmdRequest: escrow request ID — one request by its x-request-id.
func cmdRequest(args []string) error {
	fs, o := newFlags("request")
	pos, c, err := start(fs, args, 1, "usage: escrow request REQUEST_ID [--json|--csv]")
	if err != nil {
		return err
	}
	return show(c, o, http.MethodGet, "/requests/"+url.PathEscape(pos[0]), nil, requestTable)
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
	raws, rows, err := all[ledger.EntryInfo](c, "/orgs/"+url.PathEscape(pos[0])+"/entries", q)
	if err != nil {
		return err
	}
	if o.json {
		if err := flattenRequests(raws, rows); err != nil {
			return err
		}
	}
	return entryTable.print(o, raws, rows)
}

// flatRequest is a charge's request as entries flattens it into the entry, as in the table.
type flatRequest struct {
	RequestID  string `json:"request_id"`
	Model      string `json:"model"`
	Cost       int64  `json:"cost"`
	HoldAmount int64  `json:"hold_amount"`
}

// flattenRequests adds to each entry of raws (decoded: rows) that is a charge its request's
// fields (flatRequest): what entries --json prints.
func flattenRequests(raws []json.RawMessage, rows []ledger.EntryInfo) error {
	for i, e := range rows {
		if r := e.Request; r != nil {
			var err error
			if raws[i], err = withFields(raws[i], flatRequest{r.ID, r.Model, r.Cost, r.HoldAmount}); err != nil {
				return err
			}
		}
	}
	return nil
}

// cmdAudit: escrow audit — every admin write, newest first.
func cmdAudit(args []string) error {
	fs, o := newFlags("audit")
	_, c, err := start(fs, args, 0, "usage: escrow audit [--json|--csv]")
	if err != nil {
		return err
	}
	return list(c, o, "/audit", url.Values{"limit": {pageLimit}}, auditTable)
}

// cmdReconcile: escrow reconcile ORG — the org's hot balance against the ledger; a drift is
// repaired (the hot balance is dropped and reseeds on the next request).
func cmdReconcile(args []string) error {
	fs, o := newFlags("reconcile")
	pos, c, err := start(fs, args, 1, "usage: escrow reconcile ORG [--json|--csv]")
	if err != nil {
		return err
	}
	return show(c, o, http.MethodPost, "/orgs/"+url.PathEscape(pos[0])+"/reconcile", nil, driftTable)
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
	return show(c, o, method, "/ledger/epoch", nil, epochTable)
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
	return firstPage(c, o, "/usage/top?"+q.Encode(), topTable)
}

// cmdWebhooks: escrow webhooks | create URL --events E1,E2 | delete ID | deliveries ID.
func cmdWebhooks(args []string) error {
	fs, o := newFlags("webhooks")
	events := fs.String("events", "", "comma-separated event types (create): balance.low, credit.received, key.revoked, limit.crossed")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) == 0:
		return list(c, o, "/webhooks", url.Values{"limit": {pageLimit}}, webhookTable)
	case len(pos) == 2 && pos[0] == "create" && *events != "":
		return show(c, o, http.MethodPost, "/webhooks", map[string]any{"url": pos[1], "events": strings.Split(*events, ",")}, newWebhookTable)
	case len(pos) == 2 && pos[0] == "delete":
		return c.do(http.MethodDelete, "/webhooks/"+url.PathEscape(pos[1]), nil, "deleted "+pos[1])
	case len(pos) == 2 && pos[0] == "deliveries":
		return list(c, o, "/webhooks/"+url.PathEscape(pos[1])+"/deliveries", url.Values{"limit": {pageLimit}}, deliveryTable)
	default:
		return usageErr("usage: escrow webhooks | create URL --events TYPE[,TYPE…] | delete ID | deliveries ID  [--json|--csv]")
	}
}

// importFields are the columns of imported models that an import's lines show: each class
// they price, then the token limits.
func importFields(ms ...ledger.Model) table[ledger.Model] {
	return append(priceColumns(ms...), modelTable(nil).only("max_input_tokens", "max_output_tokens")...)
}

// defaultPrice reports whether column f of an imported model (as the import report shows it,
// defaults filled in) is a price at its class's default (pricing.Prices.IsDefault).
func defaultPrice(m ledger.Model, f string) bool {
	c, ok := strings.CutSuffix(f, ledger.PriceSuffix)
	return ok && m.Prices.IsDefault(pricing.Class(c))
}

// importModels sends a price table to POST /models/import and prints the diff: each new model
// with its prices, each changed field as old → new, the count of unchanged models, and the
// skipped entries counted by reason. A cache-write price at its default (the input price, 2× it
// for 1-hour writes: pricing.Prices.WithDefaults) is left out of the lines. --json prints
// the API's answer as it came.
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
	var r accounting.ImportReport
	if err := json.Unmarshal(raw, &r); err != nil {
		return fmt.Errorf("escrow models import: unexpected answer: %w", err)
	}
	if err := printChanges(r); err != nil {
		return err
	}
	printSkipped(r.Skipped)
	verb := "imported"
	if r.DryRun {
		verb = "would import"
	}
	fmt.Fprintf(stdout, "%s: %d new, %d changed, %d unchanged, %d skipped\n", verb, len(r.New), len(r.Changed), len(r.Unchanged), len(r.Skipped))
	return nil
}

// printChanges prints an import's lines: new models, changed ones, prices rounded up.
func printChanges(r accounting.ImportReport) error {
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if r.DryRun {
		fmt.Fprintln(tw, "dry run: nothing written")
	}
	for _, m := range r.New {
		fmt.Fprintf(tw, "new\t%s\t%s\n", m.Name, strings.Join(newPrices(m), ", "))
	}
	for _, ch := range r.Changed {
		fmt.Fprintf(tw, "changed\t%s\t%s\n", ch.New.Name, strings.Join(priceChanges(ch), ", "))
	}
	for _, ru := range r.RoundedUp {
		fmt.Fprintf(tw, "rounded up\t%s\t(not a whole micro-unit per 1M tokens)\n", ru)
	}
	return tw.Flush()
}

// newPrices are a new model's fields as "name value", without a cache-write price the table
// left out (its default).
func newPrices(m ledger.Model) []string {
	var parts []string
	for _, f := range importFields(m) {
		if !defaultPrice(m, f.name) {
			parts = append(parts, f.name+" "+f.cell(m))
		}
	}
	return parts
}

// priceChanges are a changed model's fields as "name old → new", without a cache-write price
// at its default before and after.
func priceChanges(ch accounting.PriceChange) []string {
	var parts []string
	for _, f := range importFields(ch.Old, ch.New) {
		if a, b := f.cell(ch.Old), f.cell(ch.New); a != b && !(defaultPrice(ch.Old, f.name) && defaultPrice(ch.New, f.name)) {
			parts = append(parts, f.name+" "+a+" → "+b)
		}
	}
	return parts
}

// printSkipped prints the skipped entries of an import counted by reason, in the order the
// reasons first appear.
func printSkipped(skipped []pricing.SkippedPrice) {
	reasons := map[string]int{}
	var order []string
	for _, s := range skipped {
		if reasons[s.Reason] == 0 {
			order = append(order, s.Reason)
		}
		reasons[s.Reason]++
	}
	for _, why := range order {
		fmt.Fprintf(stdout, "skipped %d: %s\n", reasons[why], why)
	}
}

// cmdLimits: escrow limits ORG | create ORG --window W --cap N [--key ID | --project P] |
// set-cap ORG LIMIT_ID N | delete ORG LIMIT_ID.
func cmdLimits(args []string) error {
	fs, o := newFlags("limits")
	window := fs.String("window", "", "lifetime, minute, hour, day, week or month (create)")
	unit := fs.String("unit", "money", "money, requests or tokens: what the cap counts (create)")
	capArg := fs.String("cap", "", "the cap: micro-units, requests or tokens, by --unit (create)")
	key := fs.String("key", "", "a key's limit: the key id (create)")
	project := fs.String("project", "", "a project's limit: the project id (create)")
	endUser := fs.String("end-user", "", "one end user's limit: the end user id (create)")
	eachEndUser := fs.Bool("each-end-user", false, "a limit of each end user apart: one counter per end user (create)")
	requireEndUser := fs.Bool("require-end-user", false, "with --each-end-user: refuse the org's requests that name no end user (create)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	usage := usageErr("usage: escrow limits ORG | create ORG --window W [--unit money|requests|tokens] --cap N [--key ID|--project P|--end-user ID|--each-end-user [--require-end-user]] | set-cap ORG LIMIT_ID N | delete ORG LIMIT_ID | end-users ORG LIMIT_ID  [--json|--csv]")
	c, err := newClient()
	if err != nil {
		return err
	}
	switch {
	case len(pos) == 1:
		return list(c, o, "/orgs/"+url.PathEscape(pos[0])+"/limits", url.Values{}, limitViewTable)
	case len(pos) == 2 && pos[0] == "create":
		n, err := strconv.ParseInt(*capArg, 10, 64)
		scopes := 0
		for _, given := range []bool{*key != "", *project != "", *endUser != "", *eachEndUser} {
			if given {
				scopes++
			}
		}
		if err != nil || *window == "" || scopes > 1 || (*requireEndUser && !*eachEndUser) {
			return usage
		}
		body := map[string]any{"scope": "org", "window": *window, "unit": *unit, "cap": n}
		switch {
		case *key != "":
			body["scope"], body["scope_id"] = "key", *key
		case *project != "":
			body["scope"], body["scope_id"] = "project", *project
		case *endUser != "":
			body["scope"], body["scope_id"] = "end_user", *endUser
		case *eachEndUser:
			body["scope"] = "end_user"
			if *requireEndUser {
				body["require_end_user"] = true
			}
		}
		return show(c, o, http.MethodPost, "/orgs/"+url.PathEscape(pos[1])+"/limits", body, limitTable)
	case len(pos) == 4 && pos[0] == "set-cap":
		n, err := strconv.ParseInt(pos[3], 10, 64)
		if err != nil {
			return usageErr("the cap must be a whole number of micro-units, not %q", pos[3])
		}
		return show(c, o, http.MethodPatch, "/orgs/"+url.PathEscape(pos[1])+"/limits/"+url.PathEscape(pos[2]), map[string]any{"cap": n}, limitTable)
	case len(pos) == 3 && pos[0] == "delete":
		return c.do(http.MethodDelete, "/orgs/"+url.PathEscape(pos[1])+"/limits/"+url.PathEscape(pos[2]), nil, "deleted "+pos[2])
	case len(pos) == 3 && pos[0] == "end-users": // a limit of each end user apart: its end users now
		return list(c, o, "/orgs/"+url.PathEscape(pos[1])+"/limits/"+url.PathEscape(pos[2])+"/end_users", url.Values{}, endUserTable)
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
