package fakeupstream

import (
	"net/http"
	"strings"
	"time"
)

// Background responses (POST /v1/responses with "background": true): the create answers at
// once with the response "queued" (usage null); GET /v1/responses/{id} shows it "queued" for
// the first half of Options.BackgroundDelay, "in_progress" for the second, then ended:
// "completed" (with the usage a JSON reply would have had), "incomplete" ([incomplete]),
// "failed" ([bgfail]: billed its input only, as an upstream that failed after reading it).
// POST /v1/responses/{id}/cancel cancels a response that has not ended ("cancelled", billed
// its input only); DELETE /v1/responses/{id} forgets it; GET …/input_items lists its input.
// An ended response is kept Options.BackgroundKeep, then 404; [lose] makes the upstream lose
// it as soon as it ends (404), as an upstream that dropped a result; [hold] keeps it in progress
// until it is cancelled or Server.EndBackground ends it. GET with stream=true
// replays the response's events ([slow] does not apply), starting after starting_after.

type bgResponse struct {
	final    response // as it ends (completed or incomplete)
	created  time.Time
	input    string
	fail     bool
	lose     bool
	hold     bool      // [hold]: never ends unless cancelled or ended (EndBackground clears it)
	endAt    time.Time // when EndBackground ended it (zero: not)
	cancel   time.Time // when cancelled (zero: not)
	inputTok int
}

// bgState is the response as of now: its status, and whether it is gone (404).
func (s *Server) bgState(b *bgResponse, now time.Time) (response, bool) {
	out, _, gone := s.bgStateAt(b, now)
	return out, gone
}

// bgStateAt is bgState with the time the response ended (zero while it runs).
func (s *Server) bgStateAt(b *bgResponse, now time.Time) (response, time.Time, bool) {
	out, ended, gone := s.bgEnd(b, now)
	if out.Status == "queued" || out.Status == "in_progress" {
		ended = time.Time{}
	}
	return out, ended, gone
}

func (s *Server) bgEnd(b *bgResponse, now time.Time) (response, time.Time, bool) {
	d := s.opts.BackgroundDelay
	out := b.final
	ended := b.created.Add(d)
	if !b.endAt.IsZero() {
		ended = b.endAt
	}
	switch {
	case !b.cancel.IsZero():
		ended = b.cancel
		out.Status, out.Output = "cancelled", []outputItem{}
		out.Usage = &ResponsesUsage{InputTokens: b.inputTok, TotalTokens: b.inputTok}
	case b.endAt.IsZero() && now.Before(b.created.Add(d/2)):
		out.Status, out.Usage, out.Output, out.IncompleteDetails = "queued", nil, []outputItem{}, nil
		return out, ended, false
	case b.hold || now.Before(ended):
		out.Status, out.Usage, out.Output, out.IncompleteDetails = "in_progress", nil, []outputItem{}, nil
		return out, ended, false
	case b.fail:
		out.Status, out.Output, out.IncompleteDetails = "failed", []outputItem{}, nil
		out.Usage = &ResponsesUsage{InputTokens: b.inputTok, TotalTokens: b.inputTok}
	}
	if b.lose || now.After(ended.Add(s.opts.BackgroundKeep)) {
		return out, ended, true
	}
	return out, ended, false
}

// background starts a background response.
func (s *Server) background(w http.ResponseWriter, req *apiRequest, words int, last string) {
	p := s.newPlan(words, last, req.MaxOutputTokens, nil, 0)
	id, msgID := s.nextID("resp"), s.nextID("msg")
	a := answer{plan: p, id: id, created: time.Now().Unix(), out: outputWords(p.completionTokens)}
	b := &bgResponse{final: finalResponse(req, a, msgID), created: time.Now(), input: last, inputTok: p.promptTokens,
		fail: strings.Contains(last, "[bgfail]"), lose: strings.Contains(last, "[lose]"),
		hold: strings.Contains(last, "[hold]")}
	s.mu.Lock()
	if s.bg == nil {
		s.bg = map[string]*bgResponse{}
	}
	s.bg[id] = b
	s.mu.Unlock()
	out, _ := s.bgState(b, b.created)
	writeJSON(w, http.StatusOK, bgBody(out, time.Time{}))
}

// bgBody is a background response as the API shows it; an ended one has completed_at (unix
// seconds).
func bgBody(r response, ended time.Time) map[string]any {
	var completed any
	if !ended.IsZero() {
		completed = ended.Unix()
	}
	return map[string]any{"completed_at": completed, "id": r.ID, "object": r.Object, "created_at": r.CreatedAt, "status": r.Status,
		"background": true, "error": nil, "incomplete_details": r.IncompleteDetails, "max_output_tokens": r.MaxOutputTokens,
		"model": r.Model, "output": r.Output, "usage": r.Usage}
}

// backgroundRoute answers GET, DELETE /v1/responses/{id}, GET …/input_items and POST …/cancel.
func (s *Server) backgroundRoute(w http.ResponseWriter, r *http.Request) {
	rest := strings.TrimPrefix(r.URL.Path, "/v1/responses/")
	id, sub, _ := strings.Cut(rest, "/")
	now := time.Now()
	s.mu.Lock()
	b := s.bg[id]
	var (
		out   response
		ended time.Time
	)
	gone := b == nil
	if b != nil {
		out, ended, gone = s.bgStateAt(b, now)
		if gone {
			delete(s.bg, id)
		}
	}
	s.mu.Unlock()
	if gone {
		writeError(w, http.StatusNotFound, "invalid_request_error", "", "No response found with id '"+id+"'.")
		return
	}
	switch {
	case sub == "" && r.Method == http.MethodGet && r.URL.Query().Get("stream") == "true":
		e := startSSE(w)
		evs := []string{"response.created", "response.in_progress"}
		if out.Status != "queued" && out.Status != "in_progress" {
			evs = append(evs, "response."+out.Status)
		}
		after := -1
		if n, ok := parseInt(r.URL.Query().Get("starting_after")); ok {
			after = n
		}
		for i, typ := range evs {
			if i > after {
				_ = e.event(typ, map[string]any{"type": typ, "sequence_number": i, "response": bgBody(out, ended)})
			}
		}
	case sub == "" && r.Method == http.MethodGet:
		writeJSON(w, http.StatusOK, bgBody(out, ended))
	case sub == "" && r.Method == http.MethodDelete:
		s.mu.Lock()
		delete(s.bg, id)
		s.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"id": id, "object": "response", "deleted": true})
	case sub == "input_items" && r.Method == http.MethodGet:
		writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{map[string]any{"id": "msg_in_" + id,
			"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": b.input}}}},
			"has_more": false})
	case sub == "cancel" && r.Method == http.MethodPost:
		s.mu.Lock()
		if out.Status == "queued" || out.Status == "in_progress" {
			b.cancel = now
		}
		out, ended, _ = s.bgStateAt(b, now)
		s.mu.Unlock()
		writeJSON(w, http.StatusOK, bgBody(out, ended))
	default:
		writeError(w, http.StatusNotFound, "invalid_request_error", "unknown_url", "Invalid URL ("+r.Method+" "+r.URL.Path+")")
	}
}

func parseInt(s string) (int, bool) {
	if s == "" || len(s) > 9 {
		return 0, false
	}
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

// EndBackground ends the held ([hold]) background response id now, as it would have ended
// without [hold]: completed, or as its other markers say. It reports whether id was a held
// response still running; a test that must see a job live before it ends uses it instead of a
// delay.
func (s *Server) EndBackground(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.bg[id]
	if b == nil || !b.hold || !b.cancel.IsZero() {
		return false
	}
	b.hold, b.endAt = false, time.Now()
	return true
}

// Background returns how many background responses the fake still keeps.
func (s *Server) Background() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.bg)
}
