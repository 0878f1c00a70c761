package endpoint

import "github.com/llmescrow/escrow/pricing"

// Speech is OpenAI's text-to-speech. The answer is audio bytes without usage, so the bill comes
// from what the request proves: the characters of its input × the model's characters price
// (per 1M, class characters), held and charged exactly. A model without a characters price is
// refused (400), nothing held.
var Speech = register(&Spec{
	Path:         "/v1/audio/speech",
	Provider:     OpenAI,
	Billed:       true,
	NoOutput:     true,
	Prove:        proveSpeech,
	StatedFields: []string{"input"},
	EndUserField: "user",
})

func proveSpeech(st Stated) (pricing.Usage, *Refusal) {
	if st.Stream {
		return pricing.Usage{}, &Refusal{Param: "stream", Message: "Streaming is not supported on /v1/audio/speech."}
	}
	if !st.HasInput {
		return pricing.Usage{}, &Refusal{Param: "input", Message: "'input' must be a string."}
	}
	return pricing.Usage{}.With(pricing.Characters, st.Chars), nil
}
