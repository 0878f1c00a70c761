package middleware

import (
	"net/http"
	"strings"

	"github.com/llmescrow/escrow/endpoint"
)

// The walk over a request body that the OpenAI endpoints (request.go) and Anthropic's Messages
// API (anthropic.go) share: members reads an object's keys as leniently as any upstream and
// refuses the hostile ones (fields.go), mustBe words a refusal as the endpoint's upstream would,
// and model, stream, output caps and tools are read the same for both. Each provider keeps only
// what its own fields mean.

// walkTop reads a request body for endpoint: one JSON object, whose top-level keys members
// checks against set. model and stream are read here, the same for both APIs; every other
// known field goes to own, with its name and rawKind. It returns the Request read and the
// walk's refusal, if any.
func walkTop(spec *endpoint.Spec, body []byte, set *fieldSet, plainMask uint64, own func(p *reqParser, name string, kind byte, v string)) (Request, *Error) {
	// The Request lives in the parser (not behind a pointer to a Request) so that it stays on
	// the stack.
	p := reqParser{r: Request{Spec: spec, N: 1, Bounded: true, Size: len(body)}}
	if e := checkJSONObject(body); e != nil {
		return p.r, e
	}
	plain := p.members(bstr(body), set, plainMask, loc{i: -1}, func(i int, v string) {
		switch name := set.names[i]; name {
		case "model":
			p.model(v)
		case "stream":
			p.r.Stream = p.boolean(name, v)
		default:
			own(&p, name, rawKind(v), v)
		}
	})
	if !plain {
		p.r.Bounded = false
	}
	return p.r, p.fail
}

// reqParser is one walk over a request body.
type reqParser struct {
	r    Request
	fail *Error
}

// allPlain is the plain mask of an object whose known fields are all plain (members).
const allPlain = ^uint64(0)

// members walks the JSON object raw with the field set of its kind. A key that a lenient
// decoder could read as a field of set must be spelled exactly and come once: otherwise the walk
// fails with keyError at l. Each known field goes to fn with its index in set and its raw value;
// the walk stops when p.fail is set. members reports whether the object is plain: no unknown
// key, and no known field outside plainMask, has a value other than null.
func (p *reqParser) members(raw string, set *fieldSet, plainMask uint64, l loc, fn func(i int, v string)) (plain bool) {
	plain = true
	var seen uint64
	forEachRaw(raw, func(key, v string) bool {
		i, kc := set.check(key, &seen)
		switch {
		case kc == keyVariant || kc == keyDuplicate:
			p.fail = keyError(l.String(), key, set.names[i], kc)
			return false
		case rawKind(v) == 'n':
		case kc == keyUnknown || plainMask&(1<<i) == 0:
			plain = false
		}
		if kc == keyOK {
			fn(i, v)
		}
		return p.fail == nil
	})
	return plain
}

// shape is what a value should have been, for mustBe.
type shape uint8

const (
	shapeBool shape = iota
	shapeString
	shapeNonEmpty
	shapePositive
	shapeArray
	shapeObject
)

// shapeKind is the rawKind of each shape's values.
var shapeKind = [...]byte{shapeBool: 't', shapeString: '"', shapeNonEmpty: '"', shapePositive: '0', shapeArray: '[', shapeObject: '{'}

// The words of each shape in the two upstreams' refusals: OpenAI's "'tools' must be an array.",
// Anthropic's (pydantic's) "tools: Input should be a valid list".
var (
	openAIShapes    = [...]string{"a boolean", "a string", "a non-empty string", "a positive integer", "an array", "an object"}
	anthropicShapes = [...]string{"a valid boolean", "a valid string", "a non-empty string", "a positive integer", "a valid list", "a valid dictionary"}
)

// mustBe fails the walk: the value at path is not of shape s.
func (p *reqParser) mustBe(path string, s shape) {
	if p.r.Spec.Provider == endpoint.Anthropic {
		p.fail = errInvalid(path, path+": Input should be "+anthropicShapes[s])
		return
	}
	p.fail = errInvalid(path, "'"+path+"' must be "+openAIShapes[s]+".")
}

// nullOr reports whether v is to be read as a value of shape s (array, object or string):
// false when it is null, and when it is of another kind (the walk fails).
func (p *reqParser) nullOr(path, v string, s shape) bool {
	switch rawKind(v) {
	case 'n':
		return false
	case shapeKind[s]:
		return true
	}
	p.mustBe(path, s)
	return false
}

// model reads the model's name, a non-empty string.
func (p *reqParser) model(v string) {
	if m := rawString(v); rawKind(v) == '"' && m != "" {
		p.r.Model = strings.Clone(m)
		return
	}
	p.mustBe("model", shapeNonEmpty)
}

// boolean reads a boolean that may be null (false).
func (p *reqParser) boolean(path, v string) bool {
	b, ok := rawBool(v)
	if !ok {
		p.mustBe(path, shapeBool)
	}
	return b
}

// capField reads an output-cap field (endpoint.CapNames): one the endpoint's upstream reads
// sizes the cap; one the endpoint does not define is refused with a 400 naming it (OpenAI's own
// answer), never held — an upstream that ignores it would generate its default instead.
func (p *reqParser) capField(name string, kind byte, v string) {
	if kind == 'n' {
		return
	}
	if p.r.Spec.Foreign(name) {
		msg := "Unsupported parameter: '" + name + "' is not supported on " + p.r.Spec.Path + "."
		if len(p.r.Spec.CapFields) > 0 {
			msg += " Use '" + p.r.Spec.CapFields[0] + "' instead."
		}
		if p.r.Spec.Provider == endpoint.Anthropic {
			msg = name + ": Extra inputs are not permitted"
		}
		p.fail = &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: name, Code: CodeUnsupportedParam, Message: msg}
		return
	}
	p.r.OutputCap = max(p.r.OutputCap, p.positive(name, v))
}

// positive reads an integer ≥ 1 (an output cap, n); 0 when v is none.
func (p *reqParser) positive(path, v string) int64 {
	n, ok := rawPositiveInt(v)
	if !ok {
		p.mustBe(path, shapePositive)
	}
	return n
}

// typeOf checks the keys of the object raw (a tool, a tool_choice) with set and returns its
// "type", which must be a string, and be there when need is set. A cache_control in it (a
// field of Anthropic's sets) is checked too.
func (p *reqParser) typeOf(raw string, set *fieldSet, l loc, need bool) (typ string) {
	if rawKind(raw) != '{' {
		p.mustBe(l.String(), shapeObject)
		return ""
	}
	have := false
	p.members(raw, set, allPlain, l, func(i int, v string) {
		switch set.names[i] {
		case "type":
			if rawKind(v) != '"' {
				p.mustBe(l.String()+".type", shapeString)
				return
			}
			typ, have = rawString(v), true
		case "cache_control":
			p.msgCache(v, l.String()+".cache_control")
		}
	})
	if p.fail == nil && need && !have {
		p.fail = errMissing(l.String()+".type", "Missing required parameter: '"+l.String()+".type'.")
	}
	return typ
}

// tools reads a tools array: each tool an object whose keys are read with set, with a "type"
// when needType. A tool the client does not run itself (clientRuns false: a hosted tool) is a
// feature the price table cannot price, and its use is not plain text.
func (p *reqParser) tools(v string, set *fieldSet, needType bool, clientRuns func(typ string) bool) {
	if !p.nullOr("tools", v, shapeArray) {
		return
	}
	j := 0
	forEachRaw(v, func(_, t string) bool {
		l := loc{field: "tools", i: j}
		j++
		typ := p.typeOf(t, set, l, needType)
		switch {
		case p.fail != nil:
		case clientRuns(typ):
			p.r.Tools = true // a definition the model reads: bytes + the endpoint's overhead
		default:
			p.r.Bounded = false
			p.r.addFeature("tool:" + typ)
		}
		return p.fail == nil
	})
}

// loc is where an object sits in the body, built into a path only for an error message:
// field[i] (i ≥ 0), then .sub[j] when sub is set. loc{field: path, i: -1} is path itself.
type loc struct {
	field string
	i     int
	sub   string
	j     int
}

func (l loc) String() string {
	s := l.field
	if l.i >= 0 {
		s = at(s, l.i)
	}
	if l.sub != "" {
		s = at(s+"."+l.sub, l.j)
	}
	return s
}
