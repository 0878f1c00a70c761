package fakeupstream

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// The fake media endpoints: POST /v1/moderations (one result per input, never flagged),
// /v1/images/generations (n images, default 1, each a small base64 "PNG" or a URL; no usage for
// dall-e style models, gpt-image usage for a model named gpt-image-*: GPTImageUsage) and
// /v1/audio/speech (audio bytes derived from the input: SpeechBytes).

// maxImages bounds n on images, as OpenAI does (dall-e-2: 10).
const maxImages = 10

func (s *Server) moderations(w http.ResponseWriter, _ *http.Request, req *apiRequest) {
	inputs := 1
	var arr []json.RawMessage
	if json.Unmarshal(req.Input, &arr) == nil {
		inputs = max(len(arr), 1)
	}
	type result struct {
		Flagged        bool               `json:"flagged"`
		Categories     map[string]bool    `json:"categories"`
		CategoryScores map[string]float64 `json:"category_scores"`
	}
	resp := struct {
		ID      string   `json:"id"`
		Model   string   `json:"model"`
		Results []result `json:"results"`
	}{ID: s.nextID("modr"), Model: req.Model}
	for range inputs {
		resp.Results = append(resp.Results, result{Categories: map[string]bool{"violence": false}, CategoryScores: map[string]float64{"violence": 0.0001}})
	}
	writeJSON(w, http.StatusOK, resp)
}

func (s *Server) imagesGenerations(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	s.images(w, req, "image_generation")
}

// images answers a generation or an edit (events named prefix + ".partial_image" and
// ".completed" when streamed).
func (s *Server) images(w http.ResponseWriter, req *apiRequest, prefix string) {
	n := int64(1)
	if req.N != nil {
		n = *req.N
	}
	if n < 1 || n > maxImages {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "integer_out_of_range",
			fmt.Sprintf("Invalid 'n': integer must be between 1 and %d.", maxImages))
		return
	}
	type image struct {
		B64JSON       string `json:"b64_json"`
		RevisedPrompt string `json:"revised_prompt,omitempty"`
	}
	resp := struct {
		Created int64           `json:"created"`
		Data    []image         `json:"data"`
		Usage   json.RawMessage `json:"usage,omitempty"`
	}{Created: time.Now().Unix()}
	var usage ImageTokenUsage
	if strings.HasPrefix(req.Model, "gpt-image") {
		partial := int64(0)
		if req.Stream {
			partial = req.PartialImages
		}
		u, ok := GPTImageUsage(req.promptText(), req.files, n, req.Size, req.Quality)
		if !ok || partial < 0 || partial > 3 {
			writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Invalid size, quality or partial_images.")
			return
		}
		u.OutputTokens += n * partial * PartialImageTokens
		u.TotalTokens = u.InputTokens + u.OutputTokens
		usage = u
		resp.Usage, _ = json.Marshal(u)
	} else if req.Stream {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Streaming is only supported for gpt-image models.")
		return
	}
	for i := range n {
		sum := sha256.Sum256([]byte(req.Model + "/" + req.Size + "/" + req.Quality + "/" + strconv.FormatInt(i, 10)))
		resp.Data = append(resp.Data, image{B64JSON: base64.StdEncoding.EncodeToString(append([]byte("\x89PNG fake "), sum[:]...))})
	}
	if !req.Stream {
		writeJSON(w, http.StatusOK, resp)
		return
	}
	// A stream: each image's partial images, then its completed event; the usage (of the whole
	// request) is on the last completed event.
	e := startSSE(w)
	for i, img := range resp.Data {
		for p := range req.PartialImages {
			if e.event(prefix+".partial_image", map[string]any{"type": prefix + ".partial_image", "b64_json": img.B64JSON,
				"partial_image_index": p, "size": req.Size, "quality": req.Quality}) != nil {
				return
			}
		}
		done := map[string]any{"type": prefix + ".completed", "b64_json": img.B64JSON, "size": req.Size, "quality": req.Quality}
		if i == len(resp.Data)-1 {
			done["usage"] = usage
		}
		if e.event(prefix+".completed", done) != nil {
			return
		}
	}
}

// PartialImageTokens are the output tokens each partial image of a gpt-image stream adds.
const PartialImageTokens = 100

// gptImageTokens is OpenAI's published table of the output tokens of one gpt-image-1 image by
// quality and size; auto is high quality at the largest size.
var gptImageTokens = map[string]map[string]int64{
	"low":    {"1024x1024": 272, "1024x1536": 408, "1536x1024": 400},
	"medium": {"1024x1024": 1056, "1024x1536": 1584, "1536x1024": 1568},
	"high":   {"1024x1024": 4160, "1024x1536": 6240, "1536x1024": 6208},
}

// GPTImageInputImageTokens is what the fake bills per uploaded image of an edit.
const GPTImageInputImageTokens = 323

// ImageTokenUsage is gpt-image's usage object.
type ImageTokenUsage struct {
	InputTokens  int64 `json:"input_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	TotalTokens  int64 `json:"total_tokens"`
	InputDetails struct {
		TextTokens  int64 `json:"text_tokens"`
		ImageTokens int64 `json:"image_tokens"`
	} `json:"input_tokens_details"`
}

// GPTImageUsage is the usage the fake reports for a gpt-image request, the most it may bill: a
// text token per byte of the prompt, GPTImageInputImageTokens per uploaded image, and n images
// at the table's tokens for the size and quality (auto or absent: high, and the largest size).
func GPTImageUsage(prompt string, files int, n int64, size, quality string) (ImageTokenUsage, bool) {
	if quality == "" || quality == "auto" {
		quality = "high"
	}
	if size == "" || size == "auto" {
		size = "1024x1536"
	}
	per, ok := gptImageTokens[quality][size]
	if !ok {
		return ImageTokenUsage{}, false
	}
	var u ImageTokenUsage
	u.InputDetails.TextTokens = int64(len(prompt))
	u.InputDetails.ImageTokens = int64(files) * GPTImageInputImageTokens
	u.InputTokens = u.InputDetails.TextTokens + u.InputDetails.ImageTokens
	u.OutputTokens = n * per
	u.TotalTokens = u.InputTokens + u.OutputTokens
	return u, true
}

// promptText is the prompt as a string ("" when it is none).
func (r *apiRequest) promptText() string {
	var s string
	_ = json.Unmarshal(r.Prompt, &s)
	return s
}

// SpeechBytes is the audio the fake answers /v1/audio/speech with for an input and voice: a
// short fake MP3 header and bytes derived from them (not valid audio; tests compare bytes).
func SpeechBytes(input, voice string) []byte {
	out := []byte("ID3\x04fake-mp3 ")
	for i := range 4 {
		sum := sha256.Sum256([]byte(strconv.Itoa(i) + "/" + voice + "/" + input))
		out = append(out, sum[:]...)
	}
	return append(out, 0, 0xff, 0xfb, '\n') // bytes that are no JSON and no UTF-8
}

func (s *Server) speech(w http.ResponseWriter, _ *http.Request, req *apiRequest) {
	var input string
	if json.Unmarshal(req.Input, &input) != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Invalid 'input': expected a string.")
		return
	}
	b := SpeechBytes(input, req.Voice)
	w.Header().Set("Content-Type", "audio/mpeg")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}

// isForm reports whether the request's body is a multipart form.
func isForm(r *http.Request) bool {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return err == nil && mt == "multipart/form-data"
}

// readForm reads a multipart body's fields into req as a Python server would read them: the
// first of a repeated field, numbers with strconv (n must be an integer), files counted in
// req.files.
func readForm(r *http.Request, body []byte, req *apiRequest) error {
	_, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	seen := map[string]bool{}
	for {
		p, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		b, err := io.ReadAll(p)
		if err != nil {
			return err
		}
		name := p.FormName()
		if p.FileName() != "" {
			req.files++
			if name == "file" && req.audio == nil {
				req.audio = b
			}
			continue
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		v := string(b)
		switch name {
		case "model":
			req.Model = v
		case "size":
			req.Size = v
		case "quality":
			req.Quality = v
		case "prompt":
			req.Prompt, _ = json.Marshal(v)
		case "stream":
			req.Stream = v == "true"
		case "partial_images":
			req.PartialImages, _ = strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		case "n":
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				return fmt.Errorf("n: %w", err)
			}
			req.N = &n
		}
	}
}

// imagesEdits answers an edit (a multipart upload with at least one image file) like a
// generation: n images, no usage.
func (s *Server) imagesEdits(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	if !isForm(r) || req.files == 0 {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "An image file is required (multipart/form-data 'image').")
		return
	}
	s.images(w, req, "image_edit")
}

// transcription answers a transcription or translation of an upload: a short text and the
// usage — for a model named gpt-4o-*transcribe*, tokens (TranscribeUsage), else the duration
// whisper reports ({"type":"duration","seconds":N}, rounded up). The duration is AudioSeconds.
func (s *Server) transcription(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	secs, ok := AudioSeconds(req.audio)
	if !isForm(r) || !ok {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Invalid file format: upload audio as 'file'.")
		return
	}
	var usage any = map[string]any{"type": "duration", "seconds": secs}
	if strings.Contains(req.Model, "transcribe") {
		usage = TranscribeUsage(secs, req.promptText())
		if req.Stream { // whisper ignores stream; a gpt-4o-transcribe stream: deltas, then the done event with the usage
			e := startSSE(w)
			for _, word := range []string{"tok1", " tok2", " tok3"} {
				if e.data(map[string]any{"type": "transcript.text.delta", "delta": word}) != nil {
					return
				}
			}
			_ = e.data(map[string]any{"type": "transcript.text.done", "text": "tok1 tok2 tok3", "usage": usage})
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"text": "tok1 tok2 tok3", "usage": usage})
}

// TranscribeTokensPerSecond are the audio tokens the fake bills per second of a token-billed
// transcription, and TranscribeOutputTokens its output tokens (the three words it answers).
const (
	TranscribeTokensPerSecond = 10
	TranscribeOutputTokens    = 3
)

// TranscribeUsage is the token usage of a gpt-4o-transcribe answer for secs seconds of audio
// and a prompt (a text token per byte).
func TranscribeUsage(secs int64, prompt string) map[string]any {
	audio, text := secs*TranscribeTokensPerSecond, int64(len(prompt))
	return map[string]any{"type": "tokens", "input_tokens": audio + text, "output_tokens": TranscribeOutputTokens,
		"total_tokens":        audio + text + TranscribeOutputTokens,
		"input_token_details": map[string]any{"audio_tokens": audio, "text_tokens": text}}
}

// AudioSeconds is how long the fake "decodes" an upload to, in whole seconds rounded up: a WAV
// file by its byte rate; an MP3 as a decoder reads it, resyncing on every MPEG-1 Layer III
// frame header it finds (1,152 samples each); anything else at 128 kbit/s (16,000 bytes a
// second). ok is false for nothing to decode.
func AudioSeconds(b []byte) (int64, bool) {
	if len(b) == 0 {
		return 0, false
	}
	if secs, ok := wavSeconds(b); ok {
		return secs, true
	}
	if len(b) >= 3 && (string(b[:3]) == "ID3" || b[0] == 0xff) {
		var micros int64
		for i := 0; i+4 <= len(b); {
			if size, rate := mpeg1Layer3(b[i:]); size > 0 {
				micros += (1152*1_000_000 + rate - 1) / rate
				i += size
				continue
			}
			i++
		}
		if micros > 0 {
			return (micros + 999_999) / 1_000_000, true
		}
	}
	return (int64(len(b)) + 15_999) / 16_000, true
}

// mpeg1Layer3 reads an MPEG-1 Layer III frame header: the frame's bytes and its sample rate (0
// when it is none).
func mpeg1Layer3(h []byte) (size int, rate int64) {
	if h[0] != 0xff || h[1]&0xfe != 0xfa { // sync, MPEG-1, Layer III
		return 0, 0
	}
	kbps := [16]int64{0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 0}[h[2]>>4]
	rate = [4]int64{44100, 48000, 32000, 0}[(h[2]>>2)&3]
	if kbps == 0 || rate == 0 {
		return 0, 0
	}
	return int(144*kbps*1000/rate) + int(h[2]>>1&1), rate
}

// wavSeconds is a WAV file's duration in whole seconds rounded up: the bytes after the data
// chunk's header over the fmt chunk's byte rate.
func wavSeconds(b []byte) (int64, bool) {
	if len(b) < 12 || string(b[:4]) != "RIFF" || string(b[8:12]) != "WAVE" {
		return 0, false
	}
	var byteRate int64
	for i := 12; i+8 <= len(b); {
		size := int(binary.LittleEndian.Uint32(b[i+4:]))
		switch string(b[i : i+4]) {
		case "fmt ":
			if i+8+16 > len(b) {
				return 0, false
			}
			byteRate = int64(binary.LittleEndian.Uint32(b[i+8+8:]))
		case "data":
			if byteRate <= 0 {
				return 0, false
			}
			return (int64(len(b)-i-8) + byteRate - 1) / byteRate, true
		}
		i += 8 + size + size%2
	}
	return 0, false
}
