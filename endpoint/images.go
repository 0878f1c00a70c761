package endpoint

import (
	"strconv"

	"github.com/llmescrow/escrow/pricing"
)

// ImagesGenerations is OpenAI's image generation (JSON), priced per image by size × quality
// (class per_image_<size>_<quality>, dall-e style): the bill is n images of the requested size
// and quality, known before the call, so the hold is exactly the charge. A size and quality
// the model has no per-image price for is refused (400 naming the class), never billed at
// another rate. Token-billed models (gpt-image: text input and image output tokens) are not
// supported yet: a model without the per-image price is refused the same way. Streaming
// (partial images, which gpt-image bills apart) is refused.
var ImagesGenerations = register(&Spec{
	Path:         "/v1/images/generations",
	Provider:     OpenAI,
	Billed:       true,
	NoOutput:     true,
	Prove:        proveImages,
	StatedFields: []string{"n", "size", "quality"},
	EndUserField: "user",
})

// The upstream's defaults when the body does not say (OpenAI's for dall-e-2 and dall-e-3).
const (
	DefaultImageSize    = "1024x1024"
	DefaultImageQuality = "standard"
	// MaxImages is the most images one request may ask for (OpenAI's bound on n).
	MaxImages = 10
)

func proveImages(st Stated) (pricing.Usage, *Refusal) {
	n := max(st.N, 1)
	if n > MaxImages {
		return pricing.Usage{}, &Refusal{Param: "n", Message: "'n' must be at most " + strconv.Itoa(MaxImages) + "."}
	}
	size, quality := st.Size, st.Quality
	if size == "" {
		size = DefaultImageSize
	}
	if quality == "" {
		quality = DefaultImageQuality
	}
	c := pricing.PerImage(size, quality)
	if _, ok := pricing.Lookup(c); !ok {
		return pricing.Usage{}, &Refusal{Param: "size", Message: "Invalid size or quality: '" + size + "', '" + quality + "'."}
	}
	return pricing.Usage{}.With(c, n), nil
}
