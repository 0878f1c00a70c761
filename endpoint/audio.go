package endpoint

import "bytes"

// How long an upload can play, known before the call (transcriptions, translations). Only
// formats whose bytes prove their length are read for a duration: a PCM WAV file (its sample
// bytes over its byte rate, WAVMillis) and an MP3 stream that is frames from end to end
// (MP3Millis: each frame's header fixes its length and its samples). The duration other
// containers declare — Ogg granule positions, FLAC's STREAMINFO total, MP4's mvhd, WebM's
// Duration — is a claim their decoders do not enforce, so for those (and an MP3 with anything
// but frames in it) the duration is bounded from the bytes at the lowest bitrate the format
// allows (AudioFloor).

// AudioFormat is a container an upload is recognized as, by its first bytes.
type AudioFormat string

const (
	FormatWAV  AudioFormat = "wav"
	FormatMP3  AudioFormat = "mp3"
	FormatOgg  AudioFormat = "ogg"  // Vorbis, Opus, FLAC in Ogg
	FormatFLAC AudioFormat = "flac" // native FLAC
	FormatMP4  AudioFormat = "mp4"  // m4a, mp4 (AAC)
	FormatWebM AudioFormat = "webm" // WebM, Matroska (Opus, Vorbis)
)

// AudioFloor is, per format, the fewest bytes one second of audio can take: the bound of an
// upload whose duration is not proven is its bytes over this, rounded up.
//
//   - mp3: 1,000 bytes (8 kbit/s, the lowest bitrate of the MPEG-2.5 Layer III table; a
//     free-format stream, which names no bitrate, is outside this bound and refused by the
//     frame walk, but not recognized in the fallback).
//   - ogg, webm: 10 bytes. Opus's smallest packet — its TOC byte and a frame count — carries up
//     to 120 ms (≈ 17 bytes a second); Vorbis's long blocks can take a byte or two each (2,048
//     samples at 8 kHz is a quarter second); container framing adds bytes to both. 10 is below
//     both.
//   - flac: 1 byte. A FLAC frame of constant subframes is about 10 bytes for up to 65,535
//     samples — at 8 kHz, 8 seconds.
//   - mp4: 1 byte. AAC of silence is a few bytes per 1,024 samples, and MP4's sample tables
//     may describe samples without storing them.
var AudioFloor = map[AudioFormat]int64{FormatMP3: 1000, FormatOgg: 10, FormatWebM: 10, FormatFLAC: 1, FormatMP4: 1}

// SniffAudio recognizes an upload's container by its first bytes; ok is false for none of the
// formats escrow can bound.
func SniffAudio(b []byte) (AudioFormat, bool) {
	switch {
	case len(b) >= 12 && string(b[0:4]) == "RIFF" && string(b[8:12]) == "WAVE":
		return FormatWAV, true
	case bytes.HasPrefix(b, []byte("OggS")):
		return FormatOgg, true
	case bytes.HasPrefix(b, []byte("fLaC")):
		return FormatFLAC, true
	case len(b) >= 8 && string(b[4:8]) == "ftyp":
		return FormatMP4, true
	case bytes.HasPrefix(b, []byte{0x1a, 0x45, 0xdf, 0xa3}):
		return FormatWebM, true
	case bytes.HasPrefix(b, []byte("ID3")), len(b) >= 2 && b[0] == 0xff && b[1]&0xe0 == 0xe0:
		return FormatMP3, true
	}
	return "", false
}

// AudioMillis is the most milliseconds an upload can play: proven (exact) for a PCM WAV and an
// MP3 of frames end to end, else its bytes at its format's AudioFloor. ok is false for an
// upload of no format escrow can bound (or a WAV that is not PCM: its format is named but its
// bytes are not samples escrow can count).
func AudioMillis(b []byte) (ms int64, proven, ok bool) {
	f, ok := SniffAudio(b)
	if !ok {
		return 0, false, false
	}
	switch f {
	case FormatWAV:
		ms, ok := WAVMillis(b)
		return ms, ok, ok
	case FormatMP3:
		if ms, ok := MP3Millis(b); ok {
			return ms, true, true
		}
	}
	floor := AudioFloor[f]
	return (int64(len(b))*1000 + floor - 1) / floor, false, true
}

// mp3Bitrates are the bitrate tables in kbit/s by [MPEG-1 or not][layer I, II, III][index];
// index 0 (free format) and 15 (bad) are not there.
var mp3Bitrates = [2][3][16]int64{
	{ // MPEG-1
		{0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448},
		{0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384},
		{0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320},
	},
	{ // MPEG-2 and 2.5
		{0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256},
		{0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160},
		{0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160},
	},
}

// mp3Rates are the sample rates by version (0: MPEG-2.5, 2: MPEG-2, 3: MPEG-1) and index.
var mp3Rates = [4][3]int64{{11025, 12000, 8000}, {}, {22050, 24000, 16000}, {44100, 48000, 32000}}

// mp3Frame reads the frame header at b: its length in bytes and its samples at rate.
func mp3Frame(b []byte) (size, samples, rate int64, ok bool) {
	if len(b) < 4 || b[0] != 0xff || b[1]&0xe0 != 0xe0 {
		return 0, 0, 0, false
	}
	version, layerBits := (b[1]>>3)&3, (b[1]>>1)&3
	brIndex, srIndex, pad := b[2]>>4, (b[2]>>2)&3, int64(b[2]>>1&1)
	if version == 1 || layerBits == 0 || brIndex == 0 || brIndex == 15 || srIndex == 3 {
		return 0, 0, 0, false
	}
	layer := 3 - int(layerBits) // 0: layer I, 1: II, 2: III
	v1 := 1
	if version == 3 {
		v1 = 0
	}
	bitrate := mp3Bitrates[v1][layer][brIndex] * 1000
	rate = mp3Rates[version][srIndex]
	switch {
	case layer == 0:
		samples, size = 384, (12*bitrate/rate+pad)*4
	case layer == 2 && version != 3:
		samples, size = 576, 72*bitrate/rate+pad
	default:
		samples, size = 1152, 144*bitrate/rate+pad
	}
	return size, samples, rate, size >= 4
}

// MP3Millis is the duration, in milliseconds rounded up, of an MP3 stream that is, after an
// optional ID3v2 tag, MPEG audio frames from end to end (an ID3v1 tag may end it): the samples
// of every frame at its rate. ok is false for anything else (bytes between frames, a frame cut
// short, a free-format frame): what a decoder resyncing past them would play is not proven.
func MP3Millis(b []byte) (ms int64, ok bool) {
	i := 0
	if len(b) >= 10 && string(b[:3]) == "ID3" {
		if b[6]|b[7]|b[8]|b[9] >= 0x80 {
			return 0, false
		}
		size := int(b[6])<<21 | int(b[7])<<14 | int(b[8])<<7 | int(b[9])
		i = 10 + size
		if b[5]&0x10 != 0 {
			i += 10 // a footer
		}
	}
	end := len(b)
	if end-i >= 128 && string(b[end-128:end-125]) == "TAG" {
		end -= 128
	}
	var micros, frames int64
	for i < end {
		size, samples, rate, ok := mp3Frame(b[i:end])
		if !ok || int64(end-i) < size {
			return 0, false
		}
		micros += (samples*1_000_000 + rate - 1) / rate
		i += int(size)
		frames++
	}
	if frames == 0 {
		return 0, false
	}
	return (micros + 999) / 1000, true
}
