package endpoint

import (
	"encoding/binary"
	"testing"
)

// pcm is a WAV file: fmt (format, channels, rate, bits; byteRate and align as given, 0: the
// right ones), then extra chunks, then data bytes of samples (declared: declared, -1 = len).
func pcm(format, channels uint16, rate uint32, bits uint16, byteRate uint32, extra []byte, samples, declared int) []byte {
	align := channels * bits / 8
	if byteRate == 0 {
		byteRate = rate * uint32(align)
	}
	b := []byte("RIFF\x00\x00\x00\x00WAVEfmt \x10\x00\x00\x00")
	b = binary.LittleEndian.AppendUint16(b, format)
	b = binary.LittleEndian.AppendUint16(b, channels)
	b = binary.LittleEndian.AppendUint32(b, rate)
	b = binary.LittleEndian.AppendUint32(b, byteRate)
	b = binary.LittleEndian.AppendUint16(b, align)
	b = binary.LittleEndian.AppendUint16(b, bits)
	b = append(b, extra...)
	if declared < 0 {
		declared = samples
	}
	b = append(b, "data"...)
	b = binary.LittleEndian.AppendUint32(b, uint32(declared))
	return append(b, make([]byte, samples)...)
}

// TestWAVMillis: the duration counts every byte after the data header at the fmt's byte rate
// (a short declared size does not shorten it), rounds up, skips other chunks (odd sizes
// padded), and refuses compressed formats and a byte rate that disagrees with the format.
func TestWAVMillis(t *testing.T) {
	list := append([]byte("LIST\x03\x00\x00\x00abc"), 0) // an odd chunk, padded
	for _, c := range []struct {
		name string
		b    []byte
		ms   int64
		ok   bool
	}{
		{"1 s mono 16 kHz", pcm(1, 1, 16000, 16, 0, nil, 32000, -1), 1000, true},
		{"rounded up", pcm(1, 1, 16000, 16, 0, nil, 32001, -1), 1001, true},
		{"stereo float 48 kHz", pcm(3, 2, 48000, 32, 0, nil, 384000*3, -1), 3000, true},
		{"LIST before data", pcm(1, 1, 8000, 8, 0, list, 16000, -1), 2000, true},
		{"short declared size", pcm(1, 1, 8000, 8, 0, nil, 16000, 10), 2000, true},
		{"lying byte rate", pcm(1, 1, 16000, 16, 1<<30, nil, 32000, -1), 0, false},
		{"mp3 in wav", pcm(0x55, 1, 16000, 16, 0, nil, 32000, -1), 0, false},
		{"no data", pcm(1, 1, 16000, 16, 0, nil, 0, -1)[:36], 0, false},
		{"mp3", []byte("ID3\x04\x00\x00\x00\x00\x00\x00"), 0, false},
	} {
		ms, ok := WAVMillis(c.b)
		if ms != c.ms || ok != c.ok {
			t.Errorf("%s: %d ms %v, want %d %v", c.name, ms, ok, c.ms, c.ok)
		}
	}
}
