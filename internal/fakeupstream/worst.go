package fakeupstream

import (
	"github.com/tidwall/gjson"
)

// The billing rule of Options.Worst: what an upstream that ignores unknown fields and bills
// every token it is allowed may bill for a body.
const (
	// WorstImageLow, WorstImageHigh: the most one image part bills under OpenAI's tile rule
	// (85 tokens at detail "low"; 85 + 170 per 512-pixel tile, at most 8 tiles after scaling
	// to 2048 and a short side of 768, otherwise); WorstImageAnthropic: an image block of the
	// Messages API (width × height / 750, images past 1.15 megapixels scaled down).
	WorstImageLow       = 85
	WorstImageHigh      = 85 + 170*8
	WorstImageAnthropic = 1600
	// WorstToolPreamble is the system prompt a provider adds when tools are defined (Anthropic
	// publishes 346 tokens for Claude 4 with tool_choice auto).
	WorstToolPreamble = 346
	// completionsDefault is the cap of a legacy completion that sends none.
	completionsDefault = 16
)

// worstRead is what Options.Worst bills for a body.
type worstRead struct {
	input      int   // input tokens
	choices    int64 // choices generated: n (chat), max(n, best_of) × prompts (completions)
	defaultCap int   // the cap of a body without one (0: MaxOutputTokens)
}

// inputFields are the members an upstream reads as input.
var inputFields = []string{"messages", "prompt", "input", "system", "instructions", "tools", "functions", "suffix"}

func (s *Server) readWorst(path string, body []byte, req *apiRequest) worstRead {
	w := worstRead{choices: 1}
	if path == "/v1/completions" {
		w.defaultCap = completionsDefault
	}
	if !s.opts.Worst {
		return w
	}
	for _, f := range inputFields {
		v := gjson.GetBytes(body, f)
		w.input += len(v.Raw)
		if (f == "tools" || f == "functions") && v.IsArray() && len(v.Array()) > 0 {
			w.input += WorstToolPreamble
		}
		if f != "tools" && f != "functions" {
			w.input += images(path, v)
		}
	}
	if req.N != nil && *req.N > 1 {
		w.choices = *req.N
	}
	if path == "/v1/completions" {
		if req.BestOf != nil && *req.BestOf > w.choices {
			w.choices = *req.BestOf
		}
		if p := gjson.GetBytes(body, "prompt"); p.IsArray() {
			if a := p.Array(); len(a) > 0 && (a[0].IsArray() || a[0].Type == gjson.String) {
				w.choices *= int64(len(a))
			}
		}
	}
	return w
}

// images is what the image parts anywhere in v bill.
func images(path string, v gjson.Result) int {
	n := 0
	switch {
	case v.IsArray():
		for _, e := range v.Array() {
			n += images(path, e)
		}
	case v.IsObject():
		switch v.Get("type").String() {
		case "image_url", "input_image":
			d := v.Get("detail").String()
			if x := v.Get("image_url.detail"); x.Exists() {
				d = x.String()
			}
			if d == "low" {
				return WorstImageLow
			}
			return WorstImageHigh
		case "image":
			return WorstImageAnthropic
		}
		v.ForEach(func(_, e gjson.Result) bool {
			n += images(path, e)
			return true
		})
	}
	return n
}
