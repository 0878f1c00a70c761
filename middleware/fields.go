package middleware

import (
	"fmt"
	"strconv"
	"unicode/utf8"
)

// One reading of the body for escrow and the upstream (issue 10).
//
// Upstreams do not read a JSON object the same way. Go's encoding/json matches field names
// case-insensitively with Unicode simple folding ("ſ" U+017F reads as "s", the Kelvin sign U+212A
// as "k"); encoding/json/v2 with case:ignore also ignores "_" and "-"; Python, JavaScript and Go
// take the last of two equal keys, gjson-style readers the first. escrow must price the request
// the upstream will serve, so it refuses (400, nothing held) any body in which, in an object
// whose contents change the price or a feature, a key that one of those readers could take for
// a field escrow knows is not spelled exactly as that field, or names it twice.
//
// The other way — re-serializing the fields escrow priced so the upstream sees only those — was
// rejected: it rewrites nested arrays (tools, messages, content parts) of bodies up to
// MaxRequestBytes on the hot path instead of walking them once without allocating; it changes
// the bytes the client sent (and the upstream's prompt cache keys on); and it still cannot say
// how an unknown upstream reads the keys it leaves alone. The official SDKs never send such keys,
// so refusing costs real clients nothing and the body reaches the upstream byte for byte.

// maxFold is longer than every folded field name: a key that folds to more bytes names none.
const maxFold = 48

// foldName appends to dst the form under which the most lenient decoders compare a key with a
// field name: ASCII letters lowered, "_" and "-" dropped (encoding/json/v2 case:ignore), and the
// only two non-ASCII runes whose simple-fold orbit holds an ASCII letter, U+017F and U+212A,
// mapped to it (TestFoldOrbits checks there are no others). ok is false when the key cannot
// fold to an ASCII name of at most maxFold bytes: then it names no field escrow knows.
func foldName(dst []byte, key string) (_ []byte, ok bool) {
	for i := 0; i < len(key); {
		c := key[i]
		if c < utf8.RuneSelf {
			i++
			switch {
			case c == '_' || c == '-':
				continue
			case 'A' <= c && c <= 'Z':
				c += 'a' - 'A'
			}
		} else {
			r, n := utf8.DecodeRuneInString(key[i:])
			i += n
			switch r {
			case '\u017f': // ſ, LATIN SMALL LETTER LONG S
				c = 's'
			case '\u212a': // K, KELVIN SIGN
				c = 'k'
			default:
				return dst, false
			}
		}
		if len(dst) >= maxFold {
			return dst, false
		}
		dst = append(dst, c)
	}
	return dst, true
}

// fieldSet is the set of field names escrow knows in one kind of object (at most 64).
type fieldSet struct {
	names []string
	fold  map[string]uint8 // folded name → index in names
}

func newFieldSet(names ...string) *fieldSet {
	if len(names) > 64 {
		panic("middleware: a field set holds at most 64 names")
	}
	s := &fieldSet{names: names, fold: make(map[string]uint8, len(names))}
	for i, n := range names {
		var buf [maxFold]byte
		f, ok := foldName(buf[:0], n)
		if !ok {
			panic("middleware: field name " + strconv.Quote(n) + " does not fold")
		}
		if j, dup := s.fold[string(f)]; dup {
			panic(fmt.Sprintf("middleware: field names %q and %q fold to the same name", names[j], n))
		}
		s.fold[string(f)] = uint8(i)
	}
	return s
}

// keyCheck is what fieldSet.check found.
type keyCheck uint8

const (
	keyUnknown   keyCheck = iota // names no field of the set under any reading
	keyOK                        // the field, spelled exactly, first time in this object
	keyVariant                   // read as a field of the set by a lenient decoder, spelled otherwise
	keyDuplicate                 // the field again in the same object
)

// check classifies one key of an object; seen is the object's bitset of fields met so far.
// It does not allocate.
func (s *fieldSet) check(key string, seen *uint64) (int, keyCheck) {
	var buf [maxFold]byte
	f, ok := foldName(buf[:0], key)
	if !ok {
		return -1, keyUnknown
	}
	i, ok := s.fold[string(f)]
	if !ok {
		return -1, keyUnknown
	}
	if key != s.names[i] {
		return int(i), keyVariant
	}
	bit := uint64(1) << i
	if *seen&bit != 0 {
		return int(i), keyDuplicate
	}
	*seen |= bit
	return int(i), keyOK
}

// mask is the bitset of the given names (all in s).
func (s *fieldSet) mask(names ...string) uint64 {
	var m uint64
	for _, n := range names {
		var seen uint64
		i, kc := s.check(n, &seen)
		if kc != keyOK {
			panic("middleware: " + strconv.Quote(n) + " is not a name of the set")
		}
		m |= 1 << i
	}
	return m
}

// keyError is the 400 for a key that check did not accept. at is where the object is ("" for
// the top level, else a path such as "tools[2]").
func keyError(at, key, canonical string, kc keyCheck) *Error {
	param, want := key, canonical
	if at != "" {
		param, want = at+"."+key, at+"."+canonical
	}
	if kc == keyDuplicate {
		return errInvalid(param, "Duplicate field '"+param+"' in the request body: a field may appear only once.")
	}
	return errInvalid(param, "Unrecognized request argument '"+param+"': JSON field names are read exactly, so write it as '"+
		want+"'.")
}

// at is the path of element i of an array field, e.g. "messages[3].content[0]".
func at(parent string, i int) string { return parent + "[" + strconv.Itoa(i) + "]" }
