package endpoint

import (
	"encoding/binary"

	"github.com/llmescrow/escrow/pricing"
)

// Transcriptions and Translations are OpenAI's speech-to-text (multipart uploads), billed per
// second of input audio (class audio_second, whisper style), bounded from the upload before
// the call: only an uncompressed PCM WAV file proves its duration (its sample bytes over the
// byte rate of its format), so any other upload is refused (400 on file), as is a model without
// an audio_second price. The hold is the duration rounded up to the second × the price, and
// so is the charge: the response is not read. Token-billed models (gpt-4o-transcribe) are not
// supported yet.
var (
	Transcriptions = register(&Spec{
		Path:         "/v1/audio/transcriptions",
		Provider:     OpenAI,
		Billed:       true,
		NoOutput:     true,
		Multipart:    true,
		Prove:        proveAudio,
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
		StatedFields: []string{"file"},
		EndUserField: "user",
	})
)

func proveAudio(st Stated) (pricing.Usage, *Refusal) {
	if st.Stream {
		return pricing.Usage{}, &Refusal{Param: "stream", Message: "Streaming is not supported on transcriptions."}
	}
	if st.Audio == nil {
		return pricing.Usage{}, &Refusal{Param: "file", Message: "'file' must be an audio file upload."}
	}
	ms, ok := WAVMillis(st.Audio)
	if !ok {
		return pricing.Usage{}, &Refusal{Param: "file", Message: "Only uncompressed PCM WAV uploads can be priced here: their duration is known before the call."}
	}
	return pricing.Usage{}.With(pricing.AudioSecond, (ms+999)/1000), nil
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
