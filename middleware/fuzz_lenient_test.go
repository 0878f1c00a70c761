package middleware

import (
	"bytes"
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/tidwall/gjson"
)

// lenientRead is what an upstream reads from a body: encoding/json into a struct (field names
// case-insensitive with Unicode simple folding, the last of duplicate keys wins), the way a Go
// upstream decodes the request.
type lenientRead struct {
	Model               *string          `json:"model"`
	MaxTokens           *int64           `json:"max_tokens"`
	MaxCompletionTokens *int64           `json:"max_completion_tokens"`
	MaxOutputTokens     *int64           `json:"max_output_tokens"`
	N                   *int64           `json:"n"`
	BestOf              *int64           `json:"best_of"`
	Stream              *bool            `json:"stream"`
	StreamOptions       *json.RawMessage `json:"stream_options"`
	Background          *bool            `json:"background"`
	Audio               json.RawMessage  `json:"audio"`
	Modalities          []string         `json:"modalities"`
	ServiceTier         *string          `json:"service_tier"`
	Tools               []struct {
		Type string `json:"type"`
	} `json:"tools"`
	ToolChoice       json.RawMessage `json:"tool_choice"`
	WebSearchOptions json.RawMessage `json:"web_search_options"`
	Messages         json.RawMessage `json:"messages"`
	Input            json.RawMessage `json:"input"`
	Prompt           json.RawMessage `json:"prompt"`
}

// lenientFields are the priced fields as the lenient reader sees them.
type lenientFields struct {
	model        string
	outputCap, n int64
	stream       bool
	includeUsage bool
	background   bool
	features     []string
	textOnly     bool   // every item and content part is text or an image of the endpoint, no stored prompt
	foreignCap   string // a non-null cap field the endpoint does not define (escrow refuses it)
}

func notNull(r json.RawMessage) bool { return len(r) > 0 && string(r) != "null" }

func readLeniently(path string, body []byte) (lenientFields, error) {
	var b lenientRead
	if err := json.Unmarshal(body, &b); err != nil {
		return lenientFields{}, err
	}
	f := lenientFields{n: 1, textOnly: true}
	spec := endpoint.Lookup(path)
	if b.Model != nil {
		f.model = *b.Model
	}
	for i, c := range []*int64{b.MaxTokens, b.MaxCompletionTokens, b.MaxOutputTokens} {
		name := []string{"max_tokens", "max_completion_tokens", "max_output_tokens"}[i]
		switch {
		case c == nil:
		case spec.Reads(name):
			f.outputCap = max(f.outputCap, *c)
		default:
			f.foreignCap = name
		}
	}
	for i, c := range []*int64{b.N, b.BestOf} {
		if c != nil && slices.Contains(spec.Choices, []string{"n", "best_of"}[i]) {
			f.n = max(f.n, *c)
		}
	}
	f.stream = b.Stream != nil && *b.Stream
	if b.StreamOptions != nil {
		var so struct {
			IncludeUsage *bool `json:"include_usage"`
		}
		if err := json.Unmarshal(*b.StreamOptions, &so); err != nil {
			return f, err
		}
		f.includeUsage = so.IncludeUsage != nil && *so.IncludeUsage
	}
	f.background = b.Background != nil && *b.Background
	feature := func(s string) {
		if !slices.Contains(f.features, s) {
			f.features = append(f.features, s)
		}
	}
	if notNull(b.Audio) {
		feature("audio")
	}
	for _, m := range b.Modalities {
		switch m {
		case "text":
		case "audio":
			feature("audio")
		default:
			feature("image_output")
		}
	}
	if b.ServiceTier != nil && *b.ServiceTier != "auto" && *b.ServiceTier != "default" {
		feature("service_tier:" + *b.ServiceTier)
	}
	for _, t := range b.Tools {
		if t.Type != "function" && t.Type != "custom" {
			feature("tool:" + t.Type)
			f.textOnly = false
		}
	}
	if bytes.HasPrefix(bytes.TrimSpace(b.ToolChoice), []byte("{")) {
		var tc struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(b.ToolChoice, &tc); err != nil {
			return f, err
		}
		if tc.Type != "function" && tc.Type != "custom" && tc.Type != "allowed_tools" {
			feature("tool:" + tc.Type)
			f.textOnly = false
		}
	}
	if notNull(b.WebSearchOptions) {
		feature("tool:web_search")
	}
	if bytes.HasPrefix(bytes.TrimSpace(b.Prompt), []byte("{")) {
		f.textOnly = false // a stored prompt
	}
	// Items and their content parts.
	part := func(raw json.RawMessage) error {
		var p struct {
			Type string `json:"type"`
		}
		if !bytes.HasPrefix(bytes.TrimSpace(raw), []byte("{")) {
			f.textOnly = false
			return nil
		}
		if err := json.Unmarshal(raw, &p); err != nil {
			return err
		}
		if p.Type == "input_audio" {
			feature("audio")
		}
		if !spec.TextPart(p.Type) && !spec.ImagePart(p.Type) {
			f.textOnly = false
		}
		return nil
	}
	parts := func(raw json.RawMessage) error {
		if !bytes.HasPrefix(bytes.TrimSpace(raw), []byte("[")) {
			return nil
		}
		var ps []json.RawMessage
		if err := json.Unmarshal(raw, &ps); err != nil {
			return err
		}
		for _, p := range ps {
			if err := part(p); err != nil {
				return err
			}
		}
		return nil
	}
	for _, list := range []json.RawMessage{b.Messages, b.Input} {
		if !bytes.HasPrefix(bytes.TrimSpace(list), []byte("[")) {
			continue
		}
		var items []json.RawMessage
		if err := json.Unmarshal(list, &items); err != nil {
			return f, err
		}
		for _, it := range items {
			if !bytes.HasPrefix(bytes.TrimSpace(it), []byte("{")) {
				continue
			}
			var item struct {
				Type    *string         `json:"type"`
				Content json.RawMessage `json:"content"`
				Output  json.RawMessage `json:"output"`
			}
			if err := json.Unmarshal(it, &item); err != nil {
				return f, err
			}
			if item.Type != nil && !textItems[*item.Type] {
				f.textOnly = false
			}
			if err := parts(item.Content); err != nil {
				return f, err
			}
			if err := parts(item.Output); err != nil {
				return f, err
			}
		}
	}
	return f, nil
}

// checkOneReading fails the test unless escrow refused body or priced exactly what the lenient
// reader, an exact last-wins reader (Python, JavaScript) and an exact first-wins reader
// (gjson) read from it.
func checkOneReading(t *testing.T, endpoint string, body []byte, r Request) {
	t.Helper()
	want, err := readLeniently(endpoint, body)
	if err != nil {
		// No upstream that decodes this strictly serves it (a type escrow does not read is
		// wrong): it answers 400 and the hold is released. Only the exact readers are compared.
		want.model = ""
	} else {
		if want.foreignCap != "" {
			t.Fatalf("escrow accepted %s, whose cap field %s its endpoint does not define", body, want.foreignCap)
		}
		if r.Model != want.model || r.OutputCap != want.outputCap || r.N != want.n || r.Stream != want.stream ||
			r.IncludeUsage != want.includeUsage || r.Background != want.background {
			t.Fatalf("escrow priced %+v, a lenient decoder reads %+v in %s", r, want, body)
		}
		got, exp := slices.Clone(r.Features), slices.Clone(want.features)
		slices.Sort(got)
		slices.Sort(exp)
		if !slices.Equal(got, exp) {
			t.Fatalf("escrow saw features %q, a lenient decoder %q in %s", got, exp, body)
		}
		if r.Bounded && !want.textOnly {
			t.Fatalf("escrow lowers the hold of %s, whose items are not all text", body)
		}
	}
	var last map[string]json.RawMessage
	if err := json.Unmarshal(body, &last); err == nil {
		var m string
		if json.Unmarshal(last["model"], &m) != nil || m != r.Model {
			t.Fatalf("escrow priced model %q, a last-wins reader reads %s in %s", r.Model, last["model"], body)
		}
	}
	if first := gjson.GetBytes(body, "model").String(); first != r.Model {
		t.Fatalf("escrow priced model %q, a first-wins reader reads %q in %s", r.Model, first, body)
	}
}

// bodyGen builds a request body from fuzz bytes: every field escrow prices, at every depth,
// spelled exactly or as a case / fold / delimiter variant, present once, twice or not at all,
// members in any order.
type bodyGen struct {
	b       []byte
	i       int
	hostile int  // 0: every key exact and once; else one key in about 2^(8-2·hostile) is not
	mutated bool // a variant spelling or a duplicate was written
}

// odd reports, at the body's hostility rate, that the next key is to be misspelled or repeated.
func (g *bodyGen) odd() bool {
	return g.hostile > 0 && g.pick(1<<(8-2*g.hostile)) == 0
}

func (g *bodyGen) pick(n int) int {
	if g.i >= len(g.b) {
		return 0
	}
	v := int(g.b[g.i]) % n
	g.i++
	return v
}

// key spells name, usually exactly.
func (g *bodyGen) key(name string) string {
	variant := name
	if !g.odd() {
		if g.pick(8) == 0 { // an escape is the same name once unescaped
			return `"\u00` + strconv.FormatInt(int64(name[0]), 16) + name[1:] + `"`
		}
		return strconv.Quote(name)
	}
	switch g.pick(6) {
	case 0:
		return strconv.Quote(name) // odd, but not this time
	case 1:
		variant = strings.ToUpper(name)
	case 2:
		variant = string(unicode.ToUpper(rune(name[0]))) + name[1:]
	case 3: // a rune whose simple fold is an ASCII letter of the name
		switch {
		case strings.Contains(name, "s"):
			variant = strings.Replace(name, "s", "\u017f", 1)
		case strings.Contains(name, "k"):
			variant = strings.Replace(name, "k", "\u212a", 1)
		default:
			variant = strings.ToUpper(name[:1]) + name[1:]
		}
	case 4: // encoding/json/v2 case:ignore ignores "_" and "-"
		if strings.Contains(name, "_") {
			variant = strings.ReplaceAll(name, "_", "")
		} else {
			variant = name + "_"
		}
	case 5:
		if strings.Contains(name, "_") {
			variant = strings.ReplaceAll(name, "_", "-")
		} else {
			variant = "-" + name
		}
	}
	g.mutated = true
	return strconv.Quote(variant)
}

func (g *bodyGen) of(vals ...string) string { return vals[g.pick(len(vals))] }

type genField struct {
	name string
	val  func() string
}

// object writes an object of fields, each 0, 1 or 2 times (required ones at least once), in
// an order the bytes choose.
func (g *bodyGen) object(fields []genField, required ...string) string {
	var members []string
	for _, f := range fields {
		times := g.pick(2)
		if times == 0 && slices.Contains(required, f.name) {
			times = 1
		}
		if times == 1 && g.odd() {
			times = 2
			g.mutated = true
		}
		for range times {
			members = append(members, g.key(f.name)+":"+f.val())
		}
	}
	for i := len(members) - 1; i > 0; i-- {
		j := g.pick(i + 1)
		members[i], members[j] = members[j], members[i]
	}
	return "{" + strings.Join(members, ",") + "}"
}

func (g *bodyGen) array(elem func() string) string {
	n := 1 + g.pick(3)
	els := make([]string, n)
	for i := range els {
		els[i] = elem()
	}
	return "[" + strings.Join(els, ",") + "]"
}

func (g *bodyGen) body(endpoint string) string {
	part := func() string {
		return g.object([]genField{
			{"type", func() string {
				return g.of(`"text"`, `"input_text"`, `"output_text"`, `"image_url"`, `"input_image"`, `"input_audio"`, `"input_file"`)
			}},
			{"text", func() string { return `"a"` }},
		}, "type")
	}
	content := func() string {
		if g.pick(3) == 0 {
			return `"hi"`
		}
		return g.array(part)
	}
	item := func() string {
		return g.object([]genField{
			{"type", func() string { return g.of(`"message"`, `"function_call_output"`, `"item_reference"`) }},
			{"role", func() string { return `"user"` }},
			{"content", content},
			{"output", content},
		})
	}
	tool := func() string {
		return g.object([]genField{
			{"type", func() string { return g.of(`"function"`, `"custom"`, `"web_search_preview"`, `"code_interpreter"`) }},
			{"name", func() string { return `"f"` }},
		}, "type")
	}
	num := func() string { return g.of("1", "2", "16", "16384", "null") }
	fields := []genField{
		{"model", func() string { return g.of(`"cheap"`, `"dear"`) }},
		{"max_tokens", num}, {"max_completion_tokens", num}, {"max_output_tokens", num},
		{"n", num}, {"best_of", num},
		{"stream", func() string { return g.of("true", "false", "null") }},
		{"stream_options", func() string {
			return g.object([]genField{{"include_usage", func() string { return g.of("true", "false") }}})
		}},
		{"background", func() string { return g.of("false", "true") }},
		{"service_tier", func() string { return g.of(`"auto"`, `"default"`, `"priority"`, `"flex"`) }},
		{"modalities", func() string { return g.of(`["text"]`, `["text","audio"]`, `["image"]`) }},
		{"audio", func() string { return g.of(`null`, `{"voice":"alloy"}`) }},
		{"tools", func() string { return g.array(tool) }},
		{"tool_choice", func() string {
			if g.pick(2) == 0 {
				return `"auto"`
			}
			return g.object([]genField{{"type", func() string { return g.of(`"function"`, `"web_search_preview"`) }}}, "type")
		}},
		{"prompt", func() string { return g.of(`"x"`, `{"id":"pmpt_1"}`) }},
		// Not priced: variants and duplicates inside metadata are nobody's business.
		{"metadata", func() string { return g.of(`{"Model":"dear","N":"16"}`, `{"a":"1","a":"2"}`, `{}`) }},
	}
	switch endpoint {
	case EndpointChat:
		fields = append(fields, genField{"messages", func() string { return g.array(item) }})
	case EndpointResponses:
		fields = append(fields, genField{"input", func() string {
			if g.pick(3) == 0 {
				return `"hi"`
			}
			return g.array(item)
		}})
	}
	return g.object(fields, "model")
}

// FuzzOneReading drives request bodies with case variants and duplicate keys at every depth
// (issue 10): escrow either refuses the body or priced exactly the fields a lenient JSON
// decoder reads; and a body with neither variants nor duplicates is never refused.
func FuzzOneReading(f *testing.F) {
	for _, s := range []string{"", "\x00\x01\x02", "\x07\x07\x07\x07\x07", "\x09\x0a\x0b\x06\x08", strings.Repeat("\x02\x01", 40),
		strings.Repeat("\x05\x03\x09", 60), strings.Repeat("\x01", 200), strings.Repeat("\x0b\x02\x01\x00", 50)} {
		f.Add([]byte(s), uint8(0))
		f.Add([]byte(s), uint8(1))
		f.Add([]byte(s), uint8(2))
	}
	endpoints := []string{EndpointChat, EndpointResponses, EndpointCompletions}
	f.Fuzz(func(t *testing.T, choices []byte, ep uint8) {
		path := endpoints[int(ep)%len(endpoints)]
		g := &bodyGen{b: choices}
		g.hostile = g.pick(4)
		body := g.body(path)
		r, e := parseRequest(path, []byte(body))
		if e != nil {
			if e.Status != 400 || e.Type != TypeInvalidRequest {
				t.Fatalf("refusal %+v", e)
			}
			// A cap field of another endpoint is refused however it is spelled (issue 32).
			if !g.mutated && (e.Code != CodeUnsupportedParam || !endpoint.Lookup(path).Foreign(e.Param)) {
				t.Fatalf("exactly spelled body without duplicates refused (%s): %s", e.Message, body)
			}
			return
		}
		checkOneReading(t, path, []byte(body), r)
	})
}
