package middleware

import (
	"bytes"
	"strings"

	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// sseFilter reads a text/event-stream as it passes, one event at a time, without buffering the
// stream: only the current event's bytes are kept, up to maxEvent. A longer event is passed on
// as it comes and its data read by the streaming JSON scanner (bigEvent), so that its usage is
// not lost and a terminal Responses event is still held back, however large. It
//
//   - captures usage: the usage of chat/completions chunks (the last one wins) and response.usage
//     of the Responses API's terminal events (response.completed / .incomplete / .failed);
//   - holds back the final bytes — from `data: [DONE]` or a terminal Responses event on — until
//     release, so that the usage is recorded before the client sees the end of the stream;
//   - when inject is set (the middleware added stream_options.include_usage), drops the
//     usage-only chunk (empty choices + usage) and removes "usage" from the other chunks (not
//     from an event too long to keep whole: it passes as it comes);
//   - counts the streamed output text, for estimates when no usage arrives.
//
// Lines end with "\r\n", "\n" or a lone "\r", as the SSE format allows (lineEnd); a "\r" that
// ends a write is taken as a line end at once, and an "\n" that starts the next write joins it
// (crEnd), so that a stream of lone CRs passes event by event.
type sseFilter struct {
	inject    bool
	responses bool // a Responses API stream (errors are written as its error events)
	// anthropic: a Messages API stream. Usage is message_start's message.usage with
	// message_delta's (cumulative) usage over it, complete once a message_delta came;
	// message_stop is the end that is held back.
	anthropic bool
	anth      anthUsage
	anthDelta bool // a message_delta with usage was read
	// upstreamError: the upstream ended the stream with an error after the first byte (an
	// Anthropic or Responses "error" event, a chat/completions chunk with "error", a
	// response.failed without usage): the usage is estimated (estimate.go), not read.
	upstreamError bool
	maxEvent      int
	emit          func([]byte)

	cur       []byte // the current event's bytes so far
	lineStart int    // where the current line starts in cur
	big       *bigEvent
	small     usageScanner // reads each event kept whole
	inBig     bool         // the current event is too long: passing it on as it comes
	open      bool         // the client has bytes of an event whose end it has not got
	// crEnd: the last write ended in a "\r", taken as a line end; an "\n" first in the next
	// write belongs to it. dropped: the last event kept whole was left out (the usage chunk the
	// client did not ask for), and so is such an "\n".
	crEnd, dropped bool

	holding bool
	held    []byte
	heldAt  bool // the held bytes start with a whole event ([DONE] or a terminal event kept whole)

	usage     pricing.Usage
	haveUsage bool
	// usageRaw is the last top-level usage object of an OpenAI event, as sent (a proven
	// endpoint's spec reads it: gpt-image's image_generation.completed).
	usageRaw  []byte
	terminal  bool // [DONE] or a terminal Responses event was seen
	bigEvents int  // events too long to keep whole
	outBytes  int64
	outChunks int64
}

// bigEvent is the state of an event too long to keep whole: its current line's field, its
// event name, the scanner its data goes through, and the held-back end of what passed.
type bigEvent struct {
	scan      usageScanner
	field     [8]byte
	fieldLen  int
	kind      lineKind
	skipSpace bool // the value's first byte is the optional space after the colon
	lineLen   int
	name      []byte
	nameLong  bool
	dataLines int
	dataBytes int64
	tail      []byte // its last byte that is not a line end, and the line ends after it
}

type lineKind uint8

const (
	lineField lineKind = iota // the field name is still being read
	lineData
	lineEvent
	lineOther // another field, a comment, or a field name too long to be one escrow reads
)

func (f *sseFilter) Write(p []byte) {
	if f.crEnd && len(p) > 0 {
		f.crEnd = false
		if p[0] == '\n' {
			f.joinLF()
			p = p[1:]
		}
	}
	var ls lineSplitter
	for len(p) > 0 {
		seg, n := ls.next(p)
		p = p[len(seg):]
		if n > 0 && len(p) == 0 && seg[len(seg)-1] == '\r' {
			f.crEnd = true // an "\n" may come first in the next write
		}
		if f.inBig {
			f.bigSegment(seg, n)
			continue
		}
		f.cur = append(f.cur, seg...)
		if len(f.cur) > f.maxEvent {
			f.startBig()
			continue
		}
		if n == 0 {
			continue
		}
		if len(f.cur)-f.lineStart == n { // a blank line: the event ends
			f.dispatch(f.cur)
			f.cur, f.lineStart = f.cur[:0], 0
		} else {
			f.lineStart = len(f.cur)
		}
	}
}

// joinLF takes an "\n" that follows a "\r" ending the previous write: the two are one line
// end, so the "\n" goes where that "\r" went — the current event, the big event's tail, or
// after the event it ended (nowhere when that event was left out).
func (f *sseFilter) joinLF() {
	lf := []byte{'\n'}
	switch {
	case f.inBig:
		f.bigTail(lf)
	case len(f.cur) > 0:
		f.cur = append(f.cur, '\n')
		f.lineStart = len(f.cur)
	case !f.dropped:
		f.send(lf)
	}
}

// lineSplitter cuts a write into segments that each end with a line end, but the last, which
// may end without one. It remembers where the next "\r" is, so that a write with no "\r" is
// searched for one once, not once per line.
type lineSplitter struct {
	cr    int // offset of the next "\r" in the rest, relative to base; -1: none
	base  int // bytes consumed so far
	known bool
}

// next returns p's first segment and the length of its line end (0: none, 1 or 2 for "\r\n").
func (ls *lineSplitter) next(p []byte) (seg []byte, n int) {
	if !ls.known || (ls.cr >= 0 && ls.cr < ls.base) {
		ls.known, ls.cr = true, bytes.IndexByte(p, '\r')
		if ls.cr >= 0 {
			ls.cr += ls.base
		}
	}
	i := bytes.IndexByte(p, '\n')
	if ls.cr >= 0 && (i < 0 || ls.cr-ls.base < i) {
		i = ls.cr - ls.base
	}
	switch {
	case i < 0:
		seg, n = p, 0
	case p[i] == '\r' && i+1 < len(p) && p[i+1] == '\n':
		seg, n = p[:i+2], 2
	default:
		seg, n = p[:i+1], 1
	}
	ls.base += len(seg)
	return seg, n
}

// lineEnd finds the first line end of b: its offset and length (1, or 2 for "\r\n"); i < 0
// when b has none. A "\r" at the very end of b is a line end of 1.
func lineEnd(b []byte) (i, n int) {
	i = bytes.IndexAny(b, "\r\n")
	switch {
	case i < 0:
		return -1, 0
	case b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n':
		return i, 2
	}
	return i, 1
}

// endsWithBlankLine reports whether b ends with an empty line: its last line end comes right
// after another line end ("\n\n", "\r\r", "\r\n\r\n", "\n\r", …).
func endsWithBlankLine(b []byte) bool {
	switch {
	case bytes.HasSuffix(b, []byte("\r\n")):
		b = b[:len(b)-2]
	case bytes.HasSuffix(b, []byte("\n")), bytes.HasSuffix(b, []byte("\r")):
		b = b[:len(b)-1]
	default:
		return false
	}
	return len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == '\r')
}

// startBig turns the current event into a big one: what was kept of it is read line by line
// and passed on.
func (f *sseFilter) startBig() {
	f.bigEvents++
	if f.big == nil {
		f.big = &bigEvent{}
	}
	b := f.big
	b.scan.reset()
	b.scan.anthropic = f.anthropic
	*b = bigEvent{scan: b.scan, name: b.name[:0], tail: b.tail[:0]}
	f.inBig, f.open = true, true
	kept := f.cur
	f.cur, f.lineStart = f.cur[:0], 0
	var ls lineSplitter
	for len(kept) > 0 && f.inBig {
		seg, n := ls.next(kept)
		kept = kept[len(seg):]
		f.bigSegment(seg, n)
	}
}

// bigSegment reads and passes on seg, a part of a line of the big event that ends with its
// line end (n bytes of it; 0: cut by the write).
func (f *sseFilter) bigSegment(seg []byte, n int) {
	b := f.big
	ends := n > 0
	content := seg[:len(seg)-n]
	b.lineLen += len(content)
	if ends && b.lineLen == 0 {
		f.bigTail(seg)
		f.endBig()
		return
	}
	for len(content) > 0 {
		switch b.kind {
		case lineField:
			k := bytes.IndexByte(content, ':')
			name := content
			if k >= 0 {
				name = content[:k]
			}
			if b.fieldLen+len(name) > len(b.field) {
				b.kind = lineOther
				content = nil
				continue
			}
			b.fieldLen += copy(b.field[b.fieldLen:], name)
			if k < 0 {
				content = nil
				continue
			}
			content = content[k+1:]
			b.kind, b.skipSpace = fieldKind(b.field[:b.fieldLen]), true
			if b.kind == lineData {
				b.dataLine()
			}
		case lineData, lineEvent:
			if b.skipSpace {
				b.skipSpace = false
				if content[0] == ' ' {
					content = content[1:]
					continue
				}
			}
			if b.kind == lineData {
				b.scan.Write(content)
				b.dataBytes += int64(len(content))
			} else if !b.nameLong {
				if len(b.name)+len(content) > 64 {
					b.nameLong = true
				} else {
					b.name = append(b.name, content...)
				}
			}
			content = nil
		default:
			content = nil
		}
	}
	if ends {
		if b.kind == lineField && b.fieldLen > 0 && fieldKind(b.field[:b.fieldLen]) == lineData {
			b.dataLine() // "data" alone is a data line with an empty value
		}
		b.fieldLen, b.kind, b.lineLen = 0, lineField, 0
	}
	f.bigTail(seg)
}

// takeUsage takes the usage of a scanned event of the given kind: response.usage of a terminal
// Responses event (it reports true: the end of the stream), none of the other Responses
// events, the top-level usage of anything else (chat/completions chunks).
func (f *sseFilter) takeUsage(sc *usageScanner, kind string, typed bool) (terminal bool) {
	if f.anthropic {
		switch kind {
		case "message_start":
			if a, ok := sc.anthMessageUsage(); ok {
				f.anth.merge(a)
			}
		case "message_delta":
			if a, ok := sc.anthUsage(); ok {
				f.anth.merge(a)
				f.anthDelta = true
			}
		case "message_stop":
			return true
		case "error":
			f.upstreamError = true
		}
		if f.anthDelta && f.anth.complete() {
			f.setUsage(f.anth.usage())
		}
		return false
	}
	switch {
	case kind == "response.completed" || kind == "response.incomplete" || kind == "response.failed":
		if u, ok := sc.responseUsage(); ok {
			f.setUsage(u)
		} else if kind == "response.failed" {
			f.upstreamError = true // failed without a usage: estimated like any error after output
		}
		return true
	case kind == "error":
		f.upstreamError = true // a Responses error event (or an event named error)
	case typed && strings.HasPrefix(kind, "response."):
	default:
		if u, ok := sc.usage(); ok {
			f.setUsage(u)
		}
		if raw, ok := sc.rawUsage(); ok {
			f.usageRaw = append(f.usageRaw[:0], raw.Raw...)
		}
	}
	return false
}

// dataLine starts a data line of the big event: data lines join with a line feed.
func (b *bigEvent) dataLine() {
	if b.dataLines > 0 {
		b.scan.Write([]byte{'\n'})
	}
	b.dataLines++
}

func fieldKind(name []byte) lineKind {
	switch {
	case bytes.Equal(name, fieldData):
		return lineData
	case bytes.Equal(name, fieldEvent):
		return lineEvent
	}
	return lineOther
}

// bigTail passes seg on but keeps back the big event's last byte that is not a line end and
// the line ends after it: until the event is known not to be the end of the stream the client
// gets neither the line end of its last line nor the blank line that would dispatch it.
func (f *sseFilter) bigTail(seg []byte) {
	b := f.big
	k := len(seg) - 1
	for k >= 0 && (seg[k] == '\n' || seg[k] == '\r') {
		k--
	}
	if k < 0 {
		b.tail = append(b.tail, seg...) // line ends only: at most a blank line's worth
		return
	}
	f.send(b.tail)
	f.send(seg[:k])
	b.tail = append(b.tail[:0], seg[k:]...)
}

// endBig ends the big event: its usage is taken as a small event's would be, a terminal
// Responses event starts the held-back end, and its end passes on otherwise.
func (f *sseFilter) endBig() {
	b := f.big
	f.inBig, f.dropped = false, false
	b.scan.finish()
	if b.dataLines > 0 {
		kind, typed := eventKind(&b.scan, b.name)
		if f.takeUsage(&b.scan, kind, typed) {
			f.terminal, f.holding = true, true
		}
		f.countOut(b.dataBytes) // every data byte counts as text: generous
	}
	f.send(b.tail)
	b.tail = b.tail[:0]
	if !f.holding {
		f.open = false
	}
}

// finish handles an event the stream ended in the middle of.
func (f *sseFilter) finish() {
	if f.inBig {
		f.endBig()
		return
	}
	if len(f.cur) > 0 {
		f.dispatch(f.cur)
		f.cur, f.lineStart = f.cur[:0], 0
	}
}

// send passes bytes on, or keeps them once holding. A held tail is bounded: past 2×maxEvent
// (a stream that goes on after its end) it is let through.
func (f *sseFilter) send(b []byte) {
	if !f.holding {
		f.emit(b)
		return
	}
	f.held = append(f.held, b...)
	if len(f.held) > 2*f.maxEvent {
		f.emit(f.held)
		f.held, f.holding, f.open, f.heldAt = nil, false, false, false
	}
}

// hold starts holding at a whole event (dispatch's): what is held from here is the end.
func (f *sseFilter) hold() {
	if !f.holding {
		f.holding, f.heldAt = true, true
	}
}

// costPlace says where an SSE comment may go in the held-back end, without landing inside an
// event: before it (it starts with a whole event), else after it (it ends with a blank line:
// a terminal event too long to keep whole, held from its tail); neither when nothing is held.
func (f *sseFilter) costPlace() (before, after bool) {
	if len(f.held) == 0 {
		return false, false
	}
	return f.heldAt, endsWithBlankLine(f.held)
}

// release returns the held-back bytes (the end of the stream) and stops holding.
func (f *sseFilter) release() []byte {
	b := f.held
	f.held, f.holding, f.heldAt = nil, false, false
	return b
}

func (f *sseFilter) setUsage(u pricing.Usage) { f.usage, f.haveUsage = u, true }

// partialUsage is what a Messages stream said of its usage before it ended without a complete
// one: message_start's input counts (and output so far). ok is false without them.
func (f *sseFilter) partialUsage() (anthUsage, bool) {
	return f.anth, f.anthropic && f.anth.haveIn
}

// nextLine splits ev at the first line end: the line without its end, and the rest.
func nextLine(ev []byte) (line, rest []byte) {
	i, n := lineEnd(ev)
	if i < 0 {
		return ev, nil
	}
	return ev[:i], ev[i+n:]
}

// sseField splits an SSE line into field and value (one leading space of the value dropped).
func sseField(line []byte) (field, value []byte) {
	i := bytes.IndexByte(line, ':')
	if i < 0 {
		return line, nil
	}
	field, value = line[:i], line[i+1:]
	if len(value) > 0 && value[0] == ' ' {
		value = value[1:]
	}
	return field, value
}

var (
	fieldData  = []byte("data")
	fieldEvent = []byte("event")
	doneData   = []byte("[DONE]")
	errorKey   = []byte(`"error"`)
)

// dispatch reads an event kept whole: [DONE] starts the held-back end; JSON data is read for
// its usage and its output text (dispatchJSON).
func (f *sseFilter) dispatch(ev []byte) {
	f.dropped = false
	data, name, nData := eventData(ev)
	switch {
	case nData == 0:
		f.send(ev)
	case bytes.Equal(data, doneData):
		f.sendEnd(ev)
	default:
		f.dispatchJSON(ev, data, name, nData)
	}
}

// eventData returns the data of an event (its data lines joined with line feeds), its event
// name and how many data lines it has.
func eventData(ev []byte) (data, name []byte, nData int) {
	for rest := ev; len(rest) > 0; {
		var line []byte
		line, rest = nextLine(rest)
		if len(line) == 0 || line[0] == ':' {
			continue
		}
		field, value := sseField(line)
		switch {
		case bytes.Equal(field, fieldData):
			if nData == 0 {
				data = value
			} else {
				data = append(append(append([]byte(nil), data...), '\n'), value...)
			}
			nData++
		case bytes.Equal(field, fieldEvent):
			name = value
		}
	}
	return data, name, nData
}

// sendEnd sends ev, a whole event, as the start of the held-back end of the stream.
func (f *sseFilter) sendEnd(ev []byte) {
	f.terminal = true
	f.hold()
	f.send(ev)
}

// eventKind is what an event is: the "type" its data has when that is a string, else its
// event name.
func eventKind(sc *usageScanner, name []byte) (kind string, typed bool) {
	if kind, typed = sc.typeString(); !typed {
		kind = string(name)
	}
	return kind, typed
}

// responsesDelta reports whether kind is a Responses stream event with output text in "delta".
func responsesDelta(kind string) bool {
	switch kind {
	case "response.output_text.delta", "response.refusal.delta", "response.function_call_arguments.delta",
		"response.custom_tool_call_input.delta", "response.reasoning_text.delta", "response.reasoning_summary_text.delta":
		return true
	}
	return false
}

// dispatchJSON reads an event kept whole whose data is not [DONE]: its usage is taken (a
// terminal Responses event starts the held-back end), its output text counted, and the event
// passed on.
func (f *sseFilter) dispatchJSON(ev, data, name []byte, nData int) {
	// type, usage and response.usage are read by the scanner that reads events too long to
	// keep, so that keys match the same (leniently) whatever the event's size.
	sc := &f.small
	sc.reset()
	sc.anthropic = f.anthropic
	sc.Write(data)
	sc.finish()
	if !sc.complete() {
		f.send(ev)
		return
	}
	kind, typed := eventKind(sc, name)
	if f.takeUsage(sc, kind, typed) {
		f.sendEnd(ev)
		return
	}
	switch {
	case responsesDelta(kind):
		f.countOut(textLen(gjson.GetBytes(data, "delta")))
	case typed && strings.HasPrefix(kind, "response."):
		// other Responses events carry no usage
	case f.anthropic:
		if kind == "content_block_delta" {
			d := gjson.GetBytes(data, "delta")
			f.countOut(textLen(d.Get("text")) + textLen(d.Get("partial_json")) + textLen(d.Get("thinking")))
		}
	default:
		if bytes.Contains(data, errorKey) && upstreamErrorChunk(data) {
			f.upstreamError = true // a chat/completions stream's error chunk
		}
		f.chatChunk(ev, data, nData)
		return
	}
	f.send(ev)
}

// chatChunk counts the output text of a chat/completions chunk and passes it on; when escrow
// asked for the usage (inject), the usage-only chunk is dropped and "usage" is taken out of the
// others.
func (f *sseFilter) chatChunk(ev, data []byte, nData int) {
	choices := gjson.GetBytes(data, "choices")
	if choices.IsArray() {
		var n int64
		choices.ForEach(func(_, c gjson.Result) bool {
			d := c.Get("delta")
			n += textLen(d.Get("content")) + textLen(d.Get("reasoning_content")) + textLen(d.Get("refusal")) +
				textLen(d.Get("tool_calls.#.function.arguments")) + textLen(c.Get("text"))
			return true
		})
		f.countOut(n)
	}
	u := gjson.GetBytes(data, "usage")
	if f.inject && u.Exists() && nData == 1 {
		if u.Type != gjson.Null && choices.IsArray() && !choices.Get("0").Exists() {
			f.dropped = true
			return // the usage-only chunk the client did not ask for
		}
		if stripped, err := sjson.DeleteBytes(data, "usage"); err == nil {
			f.send(replaceData(ev, stripped))
			return
		}
	}
	f.send(ev)
}

func (f *sseFilter) countOut(n int64) {
	if n > 0 {
		f.outBytes += n
		f.outChunks++
	}
}

// upstreamErrorChunk reports whether a chat/completions chunk is the upstream's error
// (`data: {"error":{…}}`): an "error" member that is not null.
func upstreamErrorChunk(data []byte) bool {
	e := gjson.GetBytes(data, "error")
	return e.Exists() && e.Type != gjson.Null
}

// replaceData rebuilds an event with its single data line's value replaced.
func replaceData(ev, data []byte) []byte {
	out := make([]byte, 0, len(ev)+len(data))
	for rest := ev; len(rest) > 0; {
		full := rest
		if i, n := lineEnd(rest); i >= 0 {
			full, rest = rest[:i+n], rest[i+n:]
		} else {
			rest = nil
		}
		line, _ := nextLine(full)
		if field, _ := sseField(line); len(line) > 0 && line[0] != ':' && bytes.Equal(field, fieldData) {
			out = append(out, "data: "...)
			out = append(out, data...)
			out = append(out, full[len(line):]...) // the line's own end
			continue
		}
		out = append(out, full...)
	}
	return out
}

// textLen is the length of a string, or of the strings nested in an array.
func textLen(v gjson.Result) int64 {
	if v.Type == gjson.String {
		return int64(len(v.Str))
	}
	var n int64
	if v.IsArray() {
		v.ForEach(func(_, e gjson.Result) bool {
			n += textLen(e)
			return true
		})
	}
	return n
}
