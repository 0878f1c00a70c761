package middleware

import "github.com/llmescrow/escrow/balance"

// partTokens bounds what a request's images and tool definitions add to the input tokens its
// bytes bound (DESIGN "Endpoints": the bound never drops what the request states): each image
// part the most its detail can bill under the endpoint's image rule (or Config.ImageTokens of
// the model, at high detail), and the upstream's tool preamble (the endpoint's ToolOverhead, or
// Config.ToolTokens of the model) when the body defines tools.
func (m *middleware) partTokens(model string, r Request) int64 {
	spec := r.Spec
	low := spec.ImageTokens("low", m.cfg.ImageTokens[model])
	high := spec.ImageTokens("high", m.cfg.ImageTokens[model])
	var t int64
	if r.ImagesLow > 0 {
		t = times(low, r.ImagesLow)
	}
	if r.ImagesHigh > 0 {
		t = addClamped(t, times(high, r.ImagesHigh))
	}
	if r.Tools {
		over := spec.ToolOverhead
		if x, ok := m.cfg.ToolTokens[model]; ok && x > 0 {
			over = x
		}
		t = addClamped(t, over)
	}
	return t
}

// addClamped is a + b (both ≥ 0) clamped to balance.MaxAmount.
func addClamped(a, b int64) int64 {
	if a > balance.MaxAmount-b {
		return balance.MaxAmount
	}
	return a + b
}
