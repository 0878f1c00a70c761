package fakeupstream

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// The fake media endpoints: POST /v1/moderations (one result per input, never flagged),
// /v1/images/generations (n images, default 1, each a small base64 "PNG" or a URL, no usage:
// dall-e style) and /v1/audio/speech (audio bytes derived from the input: SpeechBytes).

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

func (s *Server) imagesGenerations(w http.ResponseWriter, _ *http.Request, req *apiRequest) {
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
		Created int64   `json:"created"`
		Data    []image `json:"data"`
	}{Created: time.Now().Unix()}
	for i := range n {
		sum := sha256.Sum256([]byte(req.Model + "/" + req.Size + "/" + req.Quality + "/" + strconv.FormatInt(i, 10)))
		resp.Data = append(resp.Data, image{B64JSON: base64.StdEncoding.EncodeToString(append([]byte("\x89PNG fake "), sum[:]...))})
	}
	writeJSON(w, http.StatusOK, resp)
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
