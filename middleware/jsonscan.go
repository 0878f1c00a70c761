package middleware

import (
	"bytes"
	"unicode/utf8"

	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// usageScanner is an incremental JSON scanner: it reads a JSON document as its bytes pass, in
// writes of any size, and keeps only what billing needs — the top-level "usage" value, the
// Responses API's "response"."usage" and the top-level "type" (for SSE events) — plus a count
// of the text it passed. Its memory is bounded by a constant (a bit per level of nesting, at
// most maxScanDepth, and captures of at most maxCapture bytes), whatever the document's size: that is why it is written by hand. The JSON
// libraries that find a field fast (gjson, jsonparser) need the whole document in memory, and
// the streaming ones (encoding/json's Decoder, jstream) buffer every token or value whole — a
// choices array of 8 MB, or one 16 MB content string, would be held.
//
// Keys are matched as leniently as a client's decoder would: escapes decoded and case folded
// the way encoding/json does (so "Usage", "us\u0061ge" and "uſage" are all "usage"), and of
// duplicates the last wins (encoding/json and Python's json both keep the last). A key named
// usage deeper in the document (inside choices, content, tool arguments) is never taken. The
// grammar is checked (structure, escapes, numbers, literals; raw control characters inside
// strings are tolerated): after a syntax error nothing more is read and no usage is reported,
// since no client could have read the document either.
type usageScanner struct {
	state scanState
	depth int
	stack []uint64 // bit d set: the container at depth d is an object (grown to at most maxScanDepth bits)

	isKey   bool // the current string is an object key
	collect bool // the current key is collected (it may name a target)
	key     [maxKeyBytes]byte
	keyLen  int
	keyLong bool
	hexLeft int
	hexVal  rune
	num     numState
	lit     string
	litPos  int

	next   target // what the value after the current key is
	inResp bool   // inside the top-level "response" object

	capT     target // the value being captured, tNone when none
	capDepth int
	capFrom  int // where the capture started in the current write
	capBuf   []byte
	capLong  bool

	usageRaw, respRaw, typeRaw []byte // the last value of each target (nil: none, or too long)
	haveUsage, haveResp        bool

	text   int64 // bytes of string values below the top level (generated text, for estimates)
	failed bool

	// anthropic: the document is the Messages API's (a message, or a stream event): its nested
	// object is "message" (message_start's message.usage) instead of "response", and usage
	// is read as Anthropic counts it (anthropicUsageOf).
	anthropic bool
}

const (
	maxScanDepth = 10000 // encoding/json's nesting limit
	maxKeyBytes  = 64    // longer keys name no target
	maxCapture   = 64 << 10
)

type scanState uint8

const (
	sValue      scanState = iota // a value is expected
	sValueOrEnd                  // after '[': a value or ']'
	sKeyOrEnd                    // after '{': a key or '}'
	sKey                         // after ',' in an object: a key
	sColon                       // after a key
	sAfter                       // after a value inside a container: ',' or its closer
	sDone                        // the top-level value ended: only whitespace may follow
	sString                      // the states from here on are inside a token (structure reads the others)
	sEscape
	sHex
	sNumber
	sLiteral
)

type numState uint8

const (
	nMinus numState = iota
	nZero
	nInt
	nDot
	nFrac
	nE
	nESign
	nExp
)

type target uint8

const (
	tNone target = iota
	tUsage
	tType
	tResponse
	tRespUsage
)

var (
	keyUsage    = []byte("usage")
	keyType     = []byte("type")
	keyResponse = []byte("response")
	keyMessage  = []byte("message")
)

// reset readies the scanner for a new document, keeping its buffers.
func (s *usageScanner) reset() {
	*s = usageScanner{capBuf: s.capBuf[:0], stack: s.stack, anthropic: s.anthropic} // push sets every bit it reads
}

func isSpace(c byte) bool { return c == ' ' || c == '\n' || c == '\r' || c == '\t' }

func (s *usageScanner) isObject(d int) bool { return s.stack[d/64]&(1<<(d%64)) != 0 }

func (s *usageScanner) push(obj bool) bool {
	if s.depth >= maxScanDepth {
		return false
	}
	s.depth++
	for s.depth/64 >= len(s.stack) {
		s.stack = append(s.stack, 0)
	}
	if obj {
		s.stack[s.depth/64] |= 1 << (s.depth % 64)
	} else {
		s.stack[s.depth/64] &^= 1 << (s.depth % 64)
	}
	return true
}

// after is the state once a value has ended.
func (s *usageScanner) after() scanState {
	if s.depth == 0 {
		return sDone
	}
	return sAfter
}

// Write scans the next bytes of the document. It is a state machine: each state's method reads
// from p[i], moves the state on and returns where it stopped; after a syntax error (fail)
// nothing more is read.
func (s *usageScanner) Write(p []byte) {
	if s.failed {
		return
	}
	s.capFrom = 0
	i := 0
	quote := -1 // where the next '"' at or after i is in p (len(p): none); kept across escapes so that a long string of escapes is read in linear time
	for i < len(p) && !s.failed {
		switch s.state {
		case sString:
			i, quote = s.stringRun(p, i, quote)
		case sEscape:
			i = s.escape(p, i)
		case sHex:
			i = s.hexDigit(p, i)
		case sNumber:
			i = s.number(p, i)
		case sLiteral:
			i = s.literal(p, i)
		default:
			i = s.structure(p, i)
		}
	}
	if s.capT != tNone { // fail ends any capture
		s.capture(p[s.capFrom:])
		s.capFrom = 0 // the capture goes on from the start of the next write
	}
}

// stringRun reads the bytes of a string from p[i] up to its next escape or its closing quote,
// whichever comes first, with the quote's place found by an earlier call (see Write).
func (s *usageScanner) stringRun(p []byte, i, quote int) (int, int) {
	if quote < i {
		if quote = bytes.IndexByte(p[i:], '"'); quote < 0 {
			quote = len(p)
		} else {
			quote += i
		}
	}
	rest := p[i:]
	n := quote - i
	if b := bytes.IndexByte(rest[:n], '\\'); b >= 0 {
		n = b
	}
	if s.collect {
		s.keyBytes(rest[:n])
	} else if !s.isKey && s.depth >= 1 {
		s.text += int64(n)
	}
	i += n
	switch {
	case i == len(p):
	case p[i] == '\\':
		s.state = sEscape
		i++
	case s.isKey:
		i++ // the closing quote
		s.keyEnd()
		s.state = sColon
	default:
		i++
		s.ended(p, i)
	}
	return i, quote
}

// unescaped maps the byte after a backslash to the byte it stands for; 0: not a valid escape
// (\u is read by hexDigit).
var unescaped = [256]byte{'"': '"', '\\': '\\', '/': '/', 'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t'}

// escape reads the byte after a backslash.
func (s *usageScanner) escape(p []byte, i int) int {
	c := p[i]
	if c == 'u' {
		s.state, s.hexLeft, s.hexVal = sHex, 4, 0
		return i + 1
	}
	e := unescaped[c]
	if e == 0 {
		s.fail()
		return i
	}
	if s.collect {
		s.keyBytes([]byte{e})
	}
	s.state = sString
	return i + 1
}

// hexDigit reads one of the four hex digits of a \u escape.
func (s *usageScanner) hexDigit(p []byte, i int) int {
	v, ok := hexValue(p[i])
	if !ok {
		s.fail()
		return i
	}
	s.hexVal = s.hexVal<<4 | rune(v)
	if s.hexLeft--; s.hexLeft == 0 {
		if s.collect {
			r := s.hexVal
			if utf8.RuneLen(r) < 0 { // a surrogate: no target name has one
				r = utf8.RuneError
			}
			s.keyBytes(utf8.AppendRune(nil, r))
		}
		s.state = sString
	}
	return i + 1
}

func hexValue(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// number reads a number's bytes: runs of digits at once, the rest one by one through numByte.
// The first byte that is not part of the number ends it and is read again in the next state.
func (s *usageScanner) number(p []byte, i int) int {
	for i < len(p) {
		if s.num == nInt || s.num == nFrac || s.num == nExp { // digits: the bulk of a number
			for i < len(p) && p[i]-'0' < 10 {
				i++
			}
			if i == len(p) {
				break
			}
		}
		if !s.numByte(p[i]) {
			if s.numComplete() {
				s.ended(p, i)
			} else {
				s.fail()
			}
			break
		}
		i++
	}
	return i
}

// numComplete reports whether the number read so far is a whole number (it may end here).
func (s *usageScanner) numComplete() bool {
	return s.num == nZero || s.num == nInt || s.num == nFrac || s.num == nExp
}

// literal reads the rest of true, false or null.
func (s *usageScanner) literal(p []byte, i int) int {
	for ; i < len(p); i++ {
		if p[i] != s.lit[s.litPos] {
			s.fail()
			break
		}
		if s.litPos++; s.litPos == len(s.lit) {
			s.ended(p, i+1)
			return i + 1
		}
	}
	return i
}

// structure reads the bytes between tokens — whitespace, the start of a value or key, a colon,
// a comma or a closer, as the state allows — up to the first byte inside a token.
func (s *usageScanner) structure(p []byte, i int) int {
	for ; i < len(p) && s.state < sString && !s.failed; i++ {
		c := p[i]
		if isSpace(c) {
			continue
		}
		switch s.state {
		case sValue, sValueOrEnd:
			if c == ']' && s.state == sValueOrEnd {
				s.close(p, i, c)
			} else {
				s.beginValue(p, i, c)
			}
		case sKeyOrEnd, sKey:
			s.beginKey(p, i, c)
		case sColon:
			if c == ':' {
				s.state = sValue
			} else {
				s.fail()
			}
		case sAfter:
			s.afterValue(p, i, c)
		case sDone:
			s.fail()
		}
	}
	return i
}

// beginKey reads the byte where an object key is expected: its opening quote, or (right after
// '{') the object's end.
func (s *usageScanner) beginKey(p []byte, i int, c byte) {
	switch {
	case c == '"':
		s.isKey, s.collect = true, s.depth == 1 || (s.depth == 2 && s.inResp)
		s.keyLen, s.keyLong = 0, false
		s.state = sString
	case c == '}' && s.state == sKeyOrEnd:
		s.close(p, i, c)
	default:
		s.fail()
	}
}

// afterValue reads the byte after a value inside a container: a comma or the closer.
func (s *usageScanner) afterValue(p []byte, i int, c byte) {
	switch c {
	case ',':
		if s.isObject(s.depth) {
			s.state = sKey
		} else {
			s.state = sValue
		}
	case '}', ']':
		s.close(p, i, c)
	default:
		s.fail()
	}
}

// beginValue starts the value whose first byte is p[i] == c.
func (s *usageScanner) beginValue(p []byte, i int, c byte) {
	t := s.next
	s.next = tNone
	if t != tNone && t != tResponse {
		s.capT, s.capDepth, s.capFrom, s.capLong = t, s.depth, i, false
		s.capBuf = s.capBuf[:0]
	}
	switch {
	case c == '{':
		if !s.push(true) {
			s.fail()
			return
		}
		if t == tResponse {
			s.inResp = true
		}
		s.state = sKeyOrEnd
	case c == '[':
		if !s.push(false) {
			s.fail()
			return
		}
		s.state = sValueOrEnd
	case c == '"':
		s.isKey, s.collect = false, false
		s.state = sString
	case c == '-':
		s.state, s.num = sNumber, nMinus
	case c == '0':
		s.state, s.num = sNumber, nZero
	case c >= '1' && c <= '9':
		s.state, s.num = sNumber, nInt
	case c == 't':
		s.state, s.lit, s.litPos = sLiteral, "true", 1
	case c == 'f':
		s.state, s.lit, s.litPos = sLiteral, "false", 1
	case c == 'n':
		s.state, s.lit, s.litPos = sLiteral, "null", 1
	default:
		s.fail()
	}
}

// numByte advances the number by c; false when c does not continue it.
func (s *usageScanner) numByte(c byte) bool {
	digit := c >= '0' && c <= '9'
	switch s.num {
	case nMinus:
		switch {
		case c == '0':
			s.num = nZero
		case digit:
			s.num = nInt
		default:
			return false
		}
	case nZero, nInt:
		switch {
		case digit && s.num == nInt:
		case c == '.':
			s.num = nDot
		case c == 'e' || c == 'E':
			s.num = nE
		default:
			return false
		}
	case nDot:
		if !digit {
			return false
		}
		s.num = nFrac
	case nFrac:
		switch {
		case digit:
		case c == 'e' || c == 'E':
			s.num = nE
		default:
			return false
		}
	case nE:
		switch {
		case c == '+' || c == '-':
			s.num = nESign
		case digit:
			s.num = nExp
		default:
			return false
		}
	case nESign:
		if !digit {
			return false
		}
		s.num = nExp
	case nExp:
		return digit
	}
	return true
}

// close ends the container at the current depth with c == p[i].
func (s *usageScanner) close(p []byte, i int, c byte) {
	if s.depth == 0 || (c == '}') != s.isObject(s.depth) {
		s.fail()
		return
	}
	if s.depth == 2 && s.inResp {
		s.inResp = false
	}
	s.depth--
	s.ended(p, i+1)
}

// ended is called when a value ended just before p[end]: its capture completes and the state
// is what follows a value.
func (s *usageScanner) ended(p []byte, end int) {
	s.valueEnd(p, end)
	s.state = s.after()
}

func (s *usageScanner) keyBytes(b []byte) {
	if s.keyLong || s.keyLen+len(b) > maxKeyBytes {
		s.keyLong = true
		return
	}
	s.keyLen += copy(s.key[s.keyLen:], b)
}

// keyEnd names the target of the value that follows the key just read.
func (s *usageScanner) keyEnd() {
	s.next = tNone
	if !s.collect || s.keyLong {
		return
	}
	k := s.key[:s.keyLen]
	switch {
	case s.depth == 1 && bytes.EqualFold(k, keyUsage):
		s.next = tUsage
	case s.depth == 1 && bytes.EqualFold(k, keyType):
		s.next = tType
	case s.depth == 1 && bytes.EqualFold(k, keyResponse) && !s.anthropic,
		s.depth == 1 && bytes.EqualFold(k, keyMessage) && s.anthropic:
		s.next = tResponse
	case s.depth == 2 && s.inResp && bytes.EqualFold(k, keyUsage):
		s.next = tRespUsage
	}
}

// valueEnd is called when a value ended just before p[end]; it completes a capture of it.
func (s *usageScanner) valueEnd(p []byte, end int) {
	if s.capT == tNone || s.depth != s.capDepth {
		return
	}
	s.capture(p[s.capFrom:end])
	var raw []byte
	if !s.capLong {
		raw = bytes.Clone(s.capBuf)
	}
	switch s.capT {
	case tUsage:
		s.usageRaw, s.haveUsage = raw, true
	case tRespUsage:
		s.respRaw, s.haveResp = raw, true
	case tType:
		s.typeRaw = raw
	}
	s.capT = tNone
}

func (s *usageScanner) capture(b []byte) {
	if s.capLong {
		return
	}
	if len(s.capBuf)+len(b) > maxCapture {
		s.capLong, s.capBuf = true, s.capBuf[:0]
		return
	}
	s.capBuf = append(s.capBuf, b...)
}

func (s *usageScanner) fail() {
	s.failed = true
	s.capT = tNone
}

// finish ends the document: a number at its very end is complete.
func (s *usageScanner) finish() {
	if !s.failed && s.state == sNumber && s.numComplete() {
		s.ended(nil, 0)
	}
}

// complete reports whether a whole JSON document was read without error.
func (s *usageScanner) complete() bool { return !s.failed && s.state == sDone }

// usage is the top-level usage read (the last one when there were several). A document cut
// short still yields the usage read before the cut; one with a syntax error yields none.
func (s *usageScanner) usage() (pricing.Usage, bool) {
	if s.failed || !s.haveUsage {
		return pricing.Usage{}, false
	}
	if s.anthropic {
		a, ok := anthropicUsageOf(gjson.ParseBytes(s.usageRaw))
		if !ok || !a.complete() {
			return pricing.Usage{}, false
		}
		return a.usage(), true
	}
	return usageOf(gjson.ParseBytes(s.usageRaw))
}

// rawUsage is the top-level usage object of an OpenAI document as read.
func (s *usageScanner) rawUsage() (gjson.Result, bool) {
	if s.failed || !s.haveUsage || s.anthropic {
		return gjson.Result{}, false
	}
	return gjson.ParseBytes(s.usageRaw), true
}

// anthUsage is the top-level usage of an Anthropic document as read, whole or partial
// (message_delta's).
func (s *usageScanner) anthUsage() (anthUsage, bool) {
	if s.failed || !s.haveUsage {
		return anthUsage{}, false
	}
	return anthropicUsageOf(gjson.ParseBytes(s.usageRaw))
}

// anthMessageUsage is message.usage of an Anthropic message_start event.
func (s *usageScanner) anthMessageUsage() (anthUsage, bool) {
	if s.failed || !s.haveResp {
		return anthUsage{}, false
	}
	return anthropicUsageOf(gjson.ParseBytes(s.respRaw))
}

// responseUsage is the last "response"."usage" read (Responses API stream events).
func (s *usageScanner) responseUsage() (pricing.Usage, bool) {
	if s.failed || !s.haveResp {
		return pricing.Usage{}, false
	}
	return usageOf(gjson.ParseBytes(s.respRaw))
}

// typeString is the top-level "type" when it is a string.
func (s *usageScanner) typeString() (string, bool) {
	if s.failed || s.typeRaw == nil {
		return "", false
	}
	v := gjson.ParseBytes(s.typeRaw)
	return v.Str, v.Type == gjson.String
}
