package endpoint

import (
	"bytes"
	"testing"
)

// mp3 is n MPEG-1 Layer III frames at 128 kbit/s, 44.1 kHz (417 bytes, 1,152 samples each).
func mp3(n int) []byte {
	frame := append([]byte{0xff, 0xfb, 0x90, 0x00}, make([]byte, 413)...)
	return bytes.Repeat(frame, n)
}

// TestAudioMillis: a PCM WAV and an MP3 of frames end to end (after an ID3v2 tag, before an
// ID3v1 one) prove their duration; an MP3 with anything between frames, or cut short, and the
// containers whose headers only claim a duration are bounded by their bytes at the format's
// floor; an unknown upload is refused.
func TestAudioMillis(t *testing.T) {
	id3 := append([]byte("ID3\x04\x00\x00\x00\x00\x00\x05"), "abcde"...)
	v1 := append([]byte("TAG"), make([]byte, 125)...)
	junk := append(append(mp3(10), make([]byte, 100)...), mp3(10)...)
	ogg := append([]byte("OggS"), make([]byte, 996)...)
	for _, c := range []struct {
		name   string
		b      []byte
		ms     int64
		proven bool
		ok     bool
	}{
		{"wav", pcm(1, 1, 16000, 16, 0, nil, 32000, -1), 1000, true, true},
		{"mp3 200 frames", mp3(200), 5225, true, true}, // 200 × 26,123 µs, rounded up
		{"mp3 tags", append(append(id3, mp3(10)...), v1...), 262, true, true},
		{"mp3 junk between frames", junk, int64(len(junk)), false, true},
		{"mp3 cut short", mp3(10)[:4000], 4000, false, true},
		{"ogg", ogg, 100_000, false, true},
		{"flac", append([]byte("fLaC"), make([]byte, 96)...), 100_000, false, true},
		{"m4a", append([]byte("\x00\x00\x00\x20ftypM4A "), make([]byte, 12)...), 24_000, false, true},
		{"webm", append([]byte{0x1a, 0x45, 0xdf, 0xa3}, make([]byte, 16)...), 2_000, false, true},
		{"unknown", []byte("not audio at all"), 0, false, false},
		{"wav not pcm", pcm(0x55, 1, 16000, 16, 0, nil, 32000, -1), 0, false, false},
	} {
		ms, proven, ok := AudioMillis(c.b)
		if ms != c.ms || proven != c.proven || ok != c.ok {
			t.Errorf("%s: %d ms proven %v ok %v, want %d %v %v", c.name, ms, proven, ok, c.ms, c.proven, c.ok)
		}
	}
}
