package endpoint

import (
	"encoding/binary"

	"github.com/llmescrow/escrow/pricing"
)

// Transcriptions and Translations are OpenAI's speech-to-text (multipart uploads), bounded
// from the upload before the call (AudioMillis: the duration a PCM WAV or an MP3 of frames
// proves, else the bytes at the format's lowest bitrate) and billed what the answer reports:
//
//   - a model with an audio_second price (whisper): held the bound in seconds, rounded up;
//     charged the answer's usage {"type":"duration","seconds":N};
//   - a model with an audio_input price (gpt-4o-transcribe): held AudioTokensPerSecond audio
//     tokens per second of the bound plus the form's text bytes as input, and the model's
//     max_output_tokens as output (a model without one is refused: the transcript has no other
//     bound), each at the highest price of its side; charged the answer's usage
//     {"type":"tokens","input_tokens","input_token_details":{"audio_tokens"},"output_tokens"}.
//
// A stream (gpt-4o-transcribe; whisper-1 ignores stream and answers JSON) carries the usage in
// its transcript.text.done event. An upload of no format escrow can bound and a model with
// neither price are refused (400), nothing held. An answer without a usage escrow can read is
// charged the hold.
var (
	Transcriptions = register(&Spec{
		Path:         "/v1/audio/transcriptions",
		Provider:     OpenAI,
		Billed:       true,
		NoOutput:     true,
		Multipart:    true,
		Prove:        proveAudio,
		Usage:        TranscriptionUsage,
		StatedFields: []string{"file"},
		EndUserField: "user",
	})
	Translations = register(&Spec{
		Path:         "/v1/audio/translations",
		Provider:     OpenAI,
		Billed:       true,
		NoOutput:     true,
		Multipart:    true,
		Prove:        proveAudio,
		Usage:        TranscriptionUsage,
		StatedFields: []string{"file"},
		EndUserField: "user",
	})
)

// AudioTokensPerSecond bounds the audio input tokens of one second of audio for a token-billed
// transcription model: OpenAI bills gpt-4o audio at about 10 tokens a second (the Realtime
// API's 100 ms a token) and prices gpt-4o-transcribe so that a minute is about 1,000 tokens
// (≈ 17 a second); 50 is above both.
const AudioTokensPerSecond = 50

// TranscriptionClasses are the classes a token-billed transcription can bill.
var TranscriptionClasses = []pricing.Class{pricing.Input, pricing.AudioInput, pricing.Output}

func proveAudio(st Stated) (pricing.Usage, *Refusal) {
	if st.Audio == nil {
		return pricing.Usage{}, &Refusal{Param: "file", Message: "'file' must be an audio file upload."}
	}
	ms, _, ok := AudioMillis(st.Audio)
	if !ok {
		return pricing.Usage{}, &Refusal{Param: "file", Message: "The upload is no audio escrow can bound before the call " +
			"(PCM WAV, MP3, Ogg, FLAC, MP4/M4A or WebM)."}
	}
	secs := (ms + 999) / 1000
	if st.Prices.Has(pricing.AudioSecond) || !st.Prices.Has(pricing.AudioInput) {
		return pricing.Usage{}.With(pricing.AudioSecond, secs), nil // unpriced: refused naming audio_second
	}
	if st.MaxOutputTokens <= 0 {
		return pricing.Usage{}, &Refusal{Param: "model", Message: "The model '" + st.Model + "' bills transcripts by tokens " +
			"and has no max_output_tokens to bound them."}
	}
	in := st.TextBytes + (ms*AudioTokensPerSecond+999)/1000
	return boundUsage(st.Prices, TranscriptionClasses, in, st.MaxOutputTokens), nil
}

// TranscriptionUsage reads the usage of a transcription or translation answer: tokens
// (input_tokens, of which input_token_details.audio_tokens are audio; output_tokens) or a
// duration (seconds, rounded up).
func TranscriptionUsage(u UsageObject) (pricing.Usage, bool) {
	if u.String("type") == "duration" {
		s, ok := u.Ceil("seconds")
		if !ok {
			return pricing.Usage{}, false
		}
		return pricing.Usage{}.With(pricing.AudioSecond, s), true
	}
	in, ok1 := u.Count("input_tokens", true)
	out, ok2 := u.Count("output_tokens", false)
	audio, ok3 := u.Count("input_token_details.audio_tokens", false)
	if !u.Has("input_token_details.audio_tokens") {
		audio, ok3 = u.Count("input_tokens_details.audio_tokens", false)
	}
	if !ok1 || !ok2 || !ok3 || audio > in {
		return pricing.Usage{}, false
	}
	return pricing.Usage{Prompt: in, Completion: out}.With(pricing.AudioInput, audio), true
}

// WAVMillis is the duration, in milliseconds rounded up, of a PCM (format 1) or IEEE-float
// (format 3) WAV file: every byte after the data chunk's header counted as samples (at least
// the data chunk: a decoder may read past a short declared size, never more bytes than
// there are), over the byte rate its fmt chunk implies. ok is false for anything else, or a
// fmt chunk whose byte rate or block align disagree with its sample format.
func WAVMillis(b []byte) (ms int64, ok bool) {
	if len(b) < 12 || string(b[0:4]) != "RIFF" || string(b[8:12]) != "WAVE" {
		return 0, false
	}
	var rate int64
	for i := 12; i+8 <= len(b); {
		id, size := string(b[i:i+4]), int64(binary.LittleEndian.Uint32(b[i+4:i+8]))
		body := i + 8
		switch id {
		case "fmt ":
			if rate != 0 || size < 16 || int64(body)+16 > int64(len(b)) {
				return 0, false
			}
			format := binary.LittleEndian.Uint16(b[body:])
			channels := int64(binary.LittleEndian.Uint16(b[body+2:]))
			sampleRate := int64(binary.LittleEndian.Uint32(b[body+4:]))
			byteRate := int64(binary.LittleEndian.Uint32(b[body+8:]))
			align := int64(binary.LittleEndian.Uint16(b[body+12:]))
			bits := int64(binary.LittleEndian.Uint16(b[body+14:]))
			if (format != 1 && format != 3) || channels < 1 || channels > 8 || sampleRate < 1000 || sampleRate > 384_000 ||
				(bits != 8 && bits != 16 && bits != 24 && bits != 32) || align != channels*bits/8 || byteRate != sampleRate*align {
				return 0, false
			}
			rate = byteRate
		case "data":
			if rate == 0 {
				return 0, false
			}
			n := int64(len(b) - body)
			return (n*1000 + rate - 1) / rate, true
		}
		next := int64(body) + size + size&1
		if next > int64(len(b)) {
			return 0, false
		}
		i = int(next)
	}
	return 0, false
}
