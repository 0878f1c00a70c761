package accounting_test

// ---- Issue 32: the media endpoints in the simulation -------------------------------------
//
// A separate block (RULES 6): requests of the media endpoints — images per image and by tokens,
// speech, transcriptions by the second and by tokens, moderations — whose hold and cost come
// from the endpoint specs, as the middleware computes them: the hold is the cost of what
// Spec.Prove gives for the stated request at the model's prices (its token bound on tokens
// limits), the cost what the fake upstream bills for the same request (the n images asked, the
// characters sent, the seconds it decodes, the usage it reports), priced the same. Such a
// request is bounded (cost ≤ hold, checked where it is recorded and on every charge), never
// fitted (its price is fixed by the request), and a moderation is a zero hold of cost 0
// (balance.ReserveRequest.Exempt, as the middleware reserves it). The draw happens at the
// step's op in [0.88, 0.92) (one case line in step, one line in drawCost, one in runSim).
//
// Token-billed requests hold thousands of tokens, above every tokens cap the other orgs draw:
// so that some are granted, they go to the media org "m", which has no tokens limit (its other
// limits stay); the other media requests go to any org.

import (
	"encoding/binary"
	"errors"
	"strings"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/pricing"
)

// simMediaPrices are the media models' prices, small enough for the simulation's balances.
var simMediaPrices = map[string]pricing.Prices{
	"dall-e": {pricing.PerImage("1024x1024", "standard"): 4, pricing.PerImage("1024x1024", "hd"): 8,
		pricing.PerImage("1792x1024", "hd"): 12},
	"gpt-image":  {pricing.Input: 1_000, pricing.ImageInput: 2_000, pricing.ImageOutput: 40_000},
	"tts":        {pricing.Characters: 1_000_000},
	"whisper":    {pricing.AudioSecond: 1},
	"transcribe": {pricing.Input: 1_000, pricing.AudioInput: 20_000, pricing.Output: 5_000},
}

// simTranscribeMaxOut is the token-billed transcription model's max output tokens.
const simTranscribeMaxOut = 2000

// simMedia is a drawn media request: what it holds and what the upstream bills for it.
type simMedia struct {
	kind           string
	hold, cost     int64
	tokens, usedTk int64 // the token bound held, and the tokens used
	exempt         bool  // a moderation: a zero hold
}

// setupMedia adds the media org "m": the same keys, project and limits as the others, but no
// tokens limit.
func (s *simulator) setupMedia() {
	const o = "m"
	s.must(s.ledger.CreateOrg(s.ctx, o))
	c := s.rnd.Int64N(150) + 1
	_, _, err := s.ledger.Credit(s.ctx, o, c, "init-m")
	s.must(err)
	s.credits[o] += c
	s.setupLimits(o)
	ls, err := s.ledger.Limits(s.ctx, o)
	s.must(err)
	for _, l := range ls.Limits {
		if l.Unit == balance.Tokens {
			s.must(s.ops.DeleteLimit(s.ctx, o, l.ID))
		}
	}
	s.orgs = append(s.orgs, o)
}

// drawMedia draws a media request of one of the specs; ok is false when the spec refuses it
// (a 400: nothing held).
func (s *simulator) drawMedia() (m simMedia, ok bool) {
	pick := func(xs ...string) string { return xs[s.rnd.IntN(len(xs))] }
	var st endpoint.Stated
	var spec *endpoint.Spec
	var bill pricing.Usage // what the upstream bills
	switch k := s.rnd.IntN(6); k {
	case 0:
		return simMedia{kind: "moderation", exempt: true}, true
	case 1: // dall-e: n images of the size and quality asked
		spec, m.kind = endpoint.ImagesGenerations, "dall-e"
		st = endpoint.Stated{N: s.rnd.Int64N(4), Size: pick("", "1024x1024", "1792x1024"), Quality: pick("", "standard", "hd")}
		size, quality := orDefault(st.Size, endpoint.DefaultImageSize), orDefault(st.Quality, endpoint.DefaultImageQuality)
		bill = pricing.Usage{}.With(pricing.PerImage(size, quality), max(st.N, 1))
	case 2: // gpt-image: the usage the upstream reports
		spec, m.kind = endpoint.ImagesGenerations, "gpt-image"
		prompt := strings.Repeat("x", s.rnd.IntN(100)+1)
		st = endpoint.Stated{N: s.rnd.Int64N(3) / 2, Size: pick("", "auto", "1024x1024", "1536x1024"), Quality: pick("", "low", "low", "medium", "auto"),
			TextBytes: int64(len(prompt)) + 40, Files: s.rnd.Int64N(2)}
		if st.Files > 0 {
			spec = endpoint.ImagesEdits
		}
		u, ok := fakeupstream.GPTImageUsage(prompt, int(st.Files), max(st.N, 1), st.Size, st.Quality)
		if !ok {
			s.t.Fatalf("seed %d: the fake bills nothing for %+v", s.seed, st)
		}
		bill = pricing.Usage{Prompt: u.InputTokens, Completion: u.OutputTokens}.With(pricing.ImageInput, u.InputDetails.ImageTokens).
			With(pricing.ImageOutput, u.OutputTokens)
	case 3: // speech: the characters of its input
		spec, m.kind = endpoint.Speech, "tts"
		st = endpoint.Stated{HasInput: true, Chars: s.rnd.Int64N(60)}
		bill = pricing.Usage{}.With(pricing.Characters, st.Chars)
	case 4: // whisper: the seconds the upstream decodes of a WAV or an Ogg upload
		spec, m.kind = endpoint.Transcriptions, "whisper"
		st = endpoint.Stated{Audio: s.drawAudio()}
		secs, _ := fakeupstream.AudioSeconds(st.Audio)
		bill = pricing.Usage{}.With(pricing.AudioSecond, secs)
	default: // a token-billed transcription of an MP3 or an Ogg upload
		spec, m.kind = endpoint.Translations, "transcribe"
		st = endpoint.Stated{Audio: s.drawAudio(), MaxOutputTokens: simTranscribeMaxOut, TextBytes: 30}
		secs, _ := fakeupstream.AudioSeconds(st.Audio)
		u := fakeupstream.TranscribeUsage(secs, "")
		in, out, audio := u["input_tokens"].(int64), int64(u["output_tokens"].(int)), u["input_token_details"].(map[string]any)["audio_tokens"].(int64)
		bill = pricing.Usage{Prompt: in, Completion: out}.With(pricing.AudioInput, audio)
	}
	prices := simMediaPrices[m.kind]
	st.Prices = prices
	proof, ref := spec.Prove(st)
	if ref != nil {
		return m, false
	}
	for c := range proof.Units {
		if !prices.Has(c) {
			return m, false // a class the model has no price for: refused (middleware provenPriced)
		}
	}
	var err error
	if m.hold, err = prices.Cost(proof); err != nil || m.hold < 0 {
		s.t.Fatalf("seed %d: %s: the proof %+v costs %d (%v)", s.seed, m.kind, proof, m.hold, err)
	}
	if m.cost, err = prices.Cost(bill); err != nil {
		s.t.Fatalf("seed %d: %s: the bill %+v: %v", s.seed, m.kind, bill, err)
	}
	if m.cost > m.hold {
		s.t.Fatalf("seed %d: %s %+v: the upstream bills %d (%+v), above the spec's bound %d (%+v)", s.seed, m.kind, st, m.cost, bill, m.hold, proof)
	}
	m.tokens, m.usedTk = proof.Tokens(), bill.Tokens()
	m.exempt = m.hold == 0 // a zero hold (no characters), reserved as the middleware does (exempt.go)
	return m, true
}

// drawAudio draws an upload: a PCM WAV (8 kHz, 8 bits, mono: its duration proven), an MP3 of
// frames end to end (proven), or an Ogg file (bounded by its bytes).
func (s *simulator) drawAudio() []byte {
	switch s.rnd.IntN(3) {
	case 0:
		n := s.rnd.IntN(8000*20) + 1
		b := []byte("RIFF\x00\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00")
		b = binary.LittleEndian.AppendUint32(b, 8000)
		b = binary.LittleEndian.AppendUint32(b, 8000)
		b = append(b, 1, 0, 8, 0)
		b = append(b, "data"...)
		b = binary.LittleEndian.AppendUint32(b, uint32(n))
		return append(b, make([]byte, n)...)
	case 1:
		frame := append([]byte{0xff, 0xfb, 0x90, 0x00}, make([]byte, 413)...)
		return []byte(strings.Repeat(string(frame), s.rnd.IntN(200)+1))
	}
	return append([]byte("OggS"), make([]byte, s.rnd.IntN(400))...)
}

func orDefault(a, b string) string {
	if a == "" {
		return b
	}
	return a
}

// mediaRequest is the step that draws a media request and reserves its hold, never fitted.
func (s *simulator) mediaRequest(o string) {
	m, ok := s.drawMedia()
	if !ok {
		s.counts["media-refused"]++
		return
	}
	s.counts["media-"+m.kind]++
	if m.tokens > 0 {
		o = "m" // a token bound is above every other org's tokens caps
	}
	id := uuid.Must(uuid.NewV7()).String()
	key, eu := s.keys[o][s.rnd.IntN(len(s.keys[o]))], s.drawEndUser()
	res, err := s.store.Reserve(s.ctx, balance.ReserveRequest{Org: o, HoldID: id, Amount: m.hold, KeyID: key, Tokens: m.tokens, EndUser: eu, Exempt: m.exempt})
	switch {
	case err == nil:
		s.counts["media-granted"]++
		s.counts["media-granted-"+m.kind]++
		s.inflight[id] = simReq{org: o, id: id, amount: m.hold, bounded: true, bound: m.hold, tokens: m.tokens, endUser: eu, key: key,
			project: res.Project, at: res.ReservedAt, media: &m}
		s.boundHold[id] = m.hold
	case errors.Is(err, balance.ErrInsufficient), errors.Is(err, balance.ErrLimit), errors.Is(err, balance.ErrFrozen):
	default:
		s.must(err)
	}
}
