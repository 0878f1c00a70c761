package middleware

import (
	"bytes"

	"github.com/llmescrow/escrow/accounting"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// sseFilter reads a text/event-stream as it passes, one event at a time, without buffering the
// stream: only the current event's bytes are kept (up to maxEvent; a longer event is passed on
// raw and not parsed). It
//
//   - captures usage: the usage of chat/completions chunks (the last one wins) and response.usage
//     of the Responses API's terminal events (response.completed / .incomplete / .failed);
//   - holds back the final bytes — from `data: [DONE]` or a terminal Responses event on — until
//     release, so that the usage is recorded before the client sees the end of the stream;
//   - when inject is set (the middleware added stream_options.include_usage), drops the
//     usage-only chunk (empty choices + usage) and removes "usage" from the other chunks;
//   - counts the streamed output text, for estimates when no usage arrives.
//
// Lines end with "\n" or "\r\n" (a lone "\r" is not a line end here).
type sseFilter struct {
	inject    bool
	responses bool // a Responses API stream (errors are written as its error events)
	maxEvent  int
	emit      func([]byte)

	cur       []byte // the current event's bytes so far
	lineStart int    // where the current line starts in cur
	overflow  bool   // the current event is too long: passing it on raw
	rawLine   int    // bytes of the current line while overflowing

	holding bool
	held    []byte

	usage      accounting.Usage
	haveUsage  bool
	terminal   bool // [DONE] or a terminal Responses event was seen
	lostEvents int  // events too long to parse
	outBytes   int64
	outChunks  int64
}

func (f *sseFilter) Write(p []byte) {
	for len(p) > 0 {
		var seg []byte
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			seg, p = p, nil
		} else {
			seg, p = p[:i+1], p[i+1:]
		}
		if f.overflow {
			f.send(seg)
			if i < 0 {
				f.rawLine += len(seg)
				continue
			}
			line := f.rawLine + len(seg)
			f.rawLine = 0
			if line == 1 || (line == 2 && len(seg) == 2 && seg[0] == '\r') {
				f.overflow = false // blank line: the long event ended
			}
			continue
		}
		f.cur = append(f.cur, seg...)
		if len(f.cur) > f.maxEvent {
			f.lostEvents++
			f.overflow = true
			f.send(f.cur)
			if k := bytes.LastIndexByte(f.cur, '\n'); k >= 0 {
				f.rawLine = len(f.cur) - k - 1
			} else {
				f.rawLine = len(f.cur)
			}
			f.cur, f.lineStart = f.cur[:0], 0
			continue
		}
		if i < 0 {
			continue
		}
		line := f.cur[f.lineStart:]
		if len(line) == 1 || (len(line) == 2 && line[0] == '\r') {
			f.dispatch(f.cur)
			f.cur, f.lineStart = f.cur[:0], 0
		} else {
			f.lineStart = len(f.cur)
		}
	}
}

// finish handles an event the stream ended in the middle of.
func (f *sseFilter) finish() {
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
		f.held, f.holding = nil, false
	}
}

// release returns the held-back bytes (the end of the stream) and stops holding.
func (f *sseFilter) release() []byte {
	b := f.held
	f.held, f.holding = nil, false
	return b
}

func (f *sseFilter) setUsage(u accounting.Usage) { f.usage, f.haveUsage = u, true }

// nextLine splits ev at the first line end: the line without its end, and the rest.
func nextLine(ev []byte) (line, rest []byte) {
	i := bytes.IndexByte(ev, '\n')
	if i < 0 {
		return ev, nil
	}
	line, rest = ev[:i], ev[i+1:]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	return line, rest
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
)

func (f *sseFilter) dispatch(ev []byte) {
	var data, name []byte
	nData := 0
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
	if nData == 0 {
		f.send(ev)
		return
	}
	if bytes.Equal(data, doneData) {
		f.terminal = true
		f.holding = true
		f.send(ev)
		return
	}
	if !gjson.ValidBytes(data) {
		f.send(ev)
		return
	}
	typ := gjson.GetBytes(data, "type")
	kind := typ.Str
	if typ.Type != gjson.String {
		kind = string(name)
	}
	switch kind {
	case "response.completed", "response.incomplete", "response.failed":
		if u, ok := usageOf(gjson.GetBytes(data, "response.usage")); ok {
			f.setUsage(u)
		}
		f.terminal = true
		f.holding = true
		f.send(ev)
		return
	case "response.output_text.delta", "response.refusal.delta", "response.function_call_arguments.delta",
		"response.custom_tool_call_input.delta", "response.reasoning_text.delta", "response.reasoning_summary_text.delta":
		f.countOut(textLen(gjson.GetBytes(data, "delta")))
		f.send(ev)
		return
	}
	if typ.Type == gjson.String && len(kind) > 9 && kind[:9] == "response." {
		f.send(ev) // other Responses events carry no usage
		return
	}
	// chat/completions chunk
	res := gjson.GetManyBytes(data, "usage", "choices")
	u, choices := res[0], res[1]
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
	if uu, ok := usageOf(u); ok {
		f.setUsage(uu)
	}
	if f.inject && u.Exists() && nData == 1 {
		if u.Type != gjson.Null && choices.IsArray() && !choices.Get("0").Exists() {
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

// replaceData rebuilds an event with its single data line's value replaced.
func replaceData(ev, data []byte) []byte {
	out := make([]byte, 0, len(ev)+len(data))
	for rest := ev; len(rest) > 0; {
		i := bytes.IndexByte(rest, '\n')
		full := rest
		if i >= 0 {
			full, rest = rest[:i+1], rest[i+1:]
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
