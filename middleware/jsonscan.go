package middleware

import (
	"bytes"
	"unicode/utf8"

	"github.com/llmescrow/escrow/accounting"
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
	sString
	sEscape
	sHex
	sNumber
	sLiteral
	sDone // the top-level value ended: only whitespace may follow
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

// Write scans the next bytes of the document.
func (s *usageScanner) Write(p []byte) {
	if s.failed {
		return
	}
	s.capFrom = 0
	i := 0
	quote := -1 // where the next '"' at or after i is in p (len(p): none); kept across escapes so that a long string of escapes is read in linear time
	for i < len(p) {
		c := p[i]
		switch s.state {
		case sString:
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
			if i == len(p) {
				continue
			}
			if p[i] == '\\' {
				s.state = sEscape
				i++
				continue
			}
			i++ // the closing quote
			if s.isKey {
				s.keyEnd()
				s.state = sColon
				continue
			}
			s.valueEnd(p, i)
			s.state = s.after()
			continue
		case sEscape:
			var e byte
			switch c {
			case '"', '\\', '/':
				e = c
			case 'b':
				e = '\b'
			case 'f':
				e = '\f'
			case 'n':
				e = '\n'
			case 'r':
				e = '\r'
			case 't':
				e = '\t'
			case 'u':
				s.state, s.hexLeft, s.hexVal = sHex, 4, 0
				i++
				continue
			default:
				s.fail()
				return
			}
			if s.collect {
				s.keyBytes([]byte{e})
			}
			s.state = sString
			i++
			continue
		case sHex:
			var v byte
			switch {
			case c >= '0' && c <= '9':
				v = c - '0'
			case c >= 'a' && c <= 'f':
				v = c - 'a' + 10
			case c >= 'A' && c <= 'F':
				v = c - 'A' + 10
			default:
				s.fail()
				return
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
			i++
			continue
		case sNumber:
			if s.num == nInt || s.num == nFrac || s.num == nExp { // digits: the bulk of a number
				j := i
				for j < len(p) && p[j]-'0' < 10 {
					j++
				}
				if i = j; i == len(p) {
					continue
				}
				c = p[i]
			}
			if s.numByte(c) {
				i++
				continue
			}
			if s.num == nMinus || s.num == nDot || s.num == nE || s.num == nESign {
				s.fail()
				return
			}
			s.valueEnd(p, i) // c is not part of the number: read it again in the next state
			s.state = s.after()
			continue
		case sLiteral:
			if c != s.lit[s.litPos] {
				s.fail()
				return
			}
			i++
			if s.litPos++; s.litPos == len(s.lit) {
				s.valueEnd(p, i)
				s.state = s.after()
			}
			continue
		}
		if isSpace(c) {
			i++
			continue
		}
		switch s.state {
		case sValue, sValueOrEnd:
			if c == ']' && s.state == sValueOrEnd {
				if !s.close(p, i, c) {
					return
				}
				i++
				continue
			}
			if !s.beginValue(p, i, c) {
				return
			}
		case sKeyOrEnd, sKey:
			switch {
			case c == '"':
				s.isKey, s.collect = true, s.depth == 1 || (s.depth == 2 && s.inResp)
				s.keyLen, s.keyLong = 0, false
				s.state = sString
			case c == '}' && s.state == sKeyOrEnd:
				if !s.close(p, i, c) {
					return
				}
			default:
				s.fail()
				return
			}
		case sColon:
			if c != ':' {
				s.fail()
				return
			}
			s.state = sValue
		case sAfter:
			switch c {
			case ',':
				if s.isObject(s.depth) {
					s.state = sKey
				} else {
					s.state = sValue
				}
			case '}', ']':
				if !s.close(p, i, c) {
					return
				}
			default:
				s.fail()
				return
			}
		case sDone:
			s.fail()
			return
		}
		i++
	}
	if s.capT != tNone {
		s.capture(p[s.capFrom:])
		s.capFrom = 0 // the capture goes on from the start of the next write
	}
}

// beginValue starts the value whose first byte is p[i] == c.
func (s *usageScanner) beginValue(p []byte, i int, c byte) bool {
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
			return false
		}
		if t == tResponse {
			s.inResp = true
		}
		s.state = sKeyOrEnd
	case c == '[':
		if !s.push(false) {
			s.fail()
			return false
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
		return false
	}
	return true
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

// close ends the container at the current depth with c.
func (s *usageScanner) close(p []byte, i int, c byte) bool {
	if s.depth == 0 || (c == '}') != s.isObject(s.depth) {
		s.fail()
		return false
	}
	if s.depth == 2 && s.inResp {
		s.inResp = false
	}
	s.depth--
	s.valueEnd(p, i+1)
	s.state = s.after()
	return true
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
	if !s.failed && s.state == sNumber && (s.num == nZero || s.num == nInt || s.num == nFrac || s.num == nExp) {
		s.valueEnd(nil, 0)
		s.state = s.after()
	}
}

// complete reports whether a whole JSON document was read without error.
func (s *usageScanner) complete() bool { return !s.failed && s.state == sDone }

// usage is the top-level usage read (the last one when there were several). A document cut
// short still yields the usage read before the cut; one with a syntax error yields none.
func (s *usageScanner) usage() (accounting.Usage, bool) {
	if s.failed || !s.haveUsage {
		return accounting.Usage{}, false
	}
	if s.anthropic {
		a, ok := anthropicUsageOf(gjson.ParseBytes(s.usageRaw))
		if !ok || !a.complete() {
			return accounting.Usage{}, false
		}
		return a.usage(), true
	}
	return usageOf(gjson.ParseBytes(s.usageRaw))
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
func (s *usageScanner) responseUsage() (accounting.Usage, bool) {
	if s.failed || !s.haveResp {
		return accounting.Usage{}, false
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
