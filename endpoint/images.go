package endpoint

import (
	"strconv"

	"github.com/llmescrow/escrow/pricing"
)

// ImagesGenerations is OpenAI's image generation (JSON). Two ways to bill, chosen by the
// model's prices:
//
//   - per image by size × quality (dall-e style, class per_image_<size>_<quality>): the bill is
//     n images of the requested size and quality, known before the call, so the hold is
//     exactly the charge. A size and quality the model has no per-image price for is refused
//     (400 naming the class), never billed at another rate.
//   - by tokens (gpt-image style: a model with an image_output price): the answer's usage is
//     the bill (input text and image tokens, output image tokens: ImageUsage), held at its
//     bound before the call — n × the most output tokens one image of that size and quality
//     can bill (ImageOutputTokens, or the model's own max: Stated.ImageOutputTokens), plus the input: the body's bytes as text tokens and each
//     uploaded image at the most input tokens one image can bill (Stated.ImageTokens, else
//     MaxInputImageTokens), every token at the highest price of its side.
//
// A stream (gpt-image only: a per-image model's is refused) carries its usage in the
// image_generation.completed (image_edit.completed) event; each partial image asked for
// (partial_images, at most MaxPartialImages) adds PartialImageTokens output tokens per image
// to the bound. A stream is of one image (n > 1 is refused).
var ImagesGenerations = register(&Spec{
	Path:         "/v1/images/generations",
	Provider:     OpenAI,
	Billed:       true,
	NoOutput:     true,
	Prove:        proveImages,
	Usage:        ImageUsage,
	StatedFields: []string{"n", "size", "quality", "partial_images"},
	EndUserField: "user",
})

// The upstream's defaults when the body does not say (OpenAI's for dall-e-2 and dall-e-3).
const (
	DefaultImageSize    = "1024x1024"
	DefaultImageQuality = "standard"
	// MaxImages is the most images one request may ask for (OpenAI's bound on n).
	MaxImages = 10
	// MaxPartialImages is the most partial images a stream may ask for, and
	// PartialImageTokens the output tokens each one adds (OpenAI's published rule).
	MaxPartialImages   = 3
	PartialImageTokens = 100
)

// ImageClasses are the classes a token-billed image request can bill.
var ImageClasses = []pricing.Class{pricing.Input, pricing.ImageInput, pricing.Output, pricing.ImageOutput}

// imageOutputTokens is OpenAI's published table of the output tokens of one gpt-image image
// (gpt-image-1, gpt-image-1-mini), by quality and size. "auto" (and an absent value) is the
// largest the upstream may choose.
var imageOutputTokens = map[string]map[string]int64{
	"low":    {"1024x1024": 272, "1024x1536": 408, "1536x1024": 400},
	"medium": {"1024x1024": 1056, "1024x1536": 1584, "1536x1024": 1568},
	"high":   {"1024x1024": 4160, "1024x1536": 6240, "1536x1024": 6208},
}

// MaxInputImageTokens bounds the input tokens of one uploaded image of a gpt-image edit when
// the model sets no max of its own: OpenAI's vision rule for gpt-image (65 + 129 per 512-pixel
// tile, at most 4 tiles: 581) plus the most that high input fidelity adds (6,240), rounded up.
const MaxInputImageTokens = 8192

// ImageOutputTokens is the most output tokens one gpt-image image of the given size and
// quality can bill ("" or "auto": the largest the upstream may pick); ok is false for a size or
// quality the table does not know (refused: the bound would be a guess).
func ImageOutputTokens(size, quality string) (int64, bool) {
	var qs []string
	switch quality {
	case "", "auto":
		qs = []string{"low", "medium", "high"}
	default:
		if _, ok := imageOutputTokens[quality]; !ok {
			return 0, false
		}
		qs = []string{quality}
	}
	var most int64
	for _, q := range qs {
		row := imageOutputTokens[q]
		if size == "" || size == "auto" {
			for _, n := range row {
				most = max(most, n)
			}
			continue
		}
		n, ok := row[size]
		if !ok {
			return 0, false
		}
		most = max(most, n)
	}
	return most, true
}

func proveImages(st Stated) (pricing.Usage, *Refusal) {
	n := max(st.N, 1)
	if n > MaxImages {
		return pricing.Usage{}, &Refusal{Param: "n", Message: "'n' must be at most " + strconv.Itoa(MaxImages) + "."}
	}
	if st.PartialImages > MaxPartialImages {
		return pricing.Usage{}, &Refusal{Param: "partial_images", Message: "'partial_images' must be at most " + strconv.Itoa(MaxPartialImages) + "."}
	}
	if st.Prices.Has(pricing.ImageOutput) {
		return proveImageTokens(st, n)
	}
	if st.Stream && st.Prices != nil { // nil: the first read, before the model's prices are known
		return pricing.Usage{}, &Refusal{Param: "stream", Message: "Streaming is not supported for a model priced per image."}
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

// proveImageTokens is the bound of a token-billed image request: every input token (the body's
// text bytes, each uploaded image at its max) in the input class of the highest price among
// ImageClasses, every output token (n images at the table's max) in the output class of the
// highest price, so that the bound's cost is MaxInputFor × input + MaxOutputFor × output.
func proveImageTokens(st Stated, n int64) (pricing.Usage, *Refusal) {
	per, ok := ImageOutputTokens(st.Size, st.Quality)
	if st.ImageOutputTokens > 0 {
		per, ok = st.ImageOutputTokens, true // the model's own max, whatever the size and quality
	}
	if !ok {
		return pricing.Usage{}, &Refusal{Param: "size", Message: "Invalid size or quality for a token-billed image model: '" + st.Size + "', '" + st.Quality + "'."}
	}
	perImage := st.ImageTokens
	if perImage <= 0 {
		perImage = MaxInputImageTokens
	}
	if st.Stream && n > 1 {
		// Whether each image's completed event carries the usage of all or of its own is not
		// published: one image per stream keeps the one usage whole.
		return pricing.Usage{}, &Refusal{Param: "n", Message: "A stream generates one image: 'n' must be 1."}
	}
	in := st.TextBytes + st.Files*perImage
	out := n * per
	if st.Stream {
		out += n * st.PartialImages * PartialImageTokens
	}
	return boundUsage(st.Prices, ImageClasses, in, out), nil
}

// boundUsage is a usage of in input and out output tokens, each side in the class of the
// highest price among classes: its cost is the bound of those tokens.
func boundUsage(p pricing.Prices, classes []pricing.Class, in, out int64) pricing.Usage {
	u := pricing.Usage{Prompt: in, Completion: out}
	top := func(side pricing.Side, price int64) pricing.Class {
		for _, c := range classes {
			info, _ := pricing.Lookup(c)
			if v, ok := p.Price(c); ok && info.Side == side && info.Tokens() && v == price {
				return c
			}
		}
		return ""
	}
	if c := top(pricing.SideInput, p.MaxInputFor(classes)); c != "" && c != pricing.Input {
		u = u.With(c, in)
	}
	if c := top(pricing.SideOutput, p.MaxOutputFor(classes)); c != "" && c != pricing.Output {
		u = u.With(c, out)
	}
	return u
}

// ImageUsage reads the usage of a gpt-image answer: input_tokens (of which
// input_tokens_details.image_tokens are image tokens, the rest text) and output_tokens (image
// tokens; of which only output_tokens_details.image_tokens when the answer splits them, the
// rest text).
func ImageUsage(u UsageObject) (pricing.Usage, bool) {
	in, ok1 := u.Count("input_tokens", true)
	out, ok2 := u.Count("output_tokens", true)
	img, ok3 := u.Count("input_tokens_details.image_tokens", false)
	outImg, ok4 := u.Count("output_tokens_details.image_tokens", false)
	if !ok1 || !ok2 || !ok3 || !ok4 || img > in || outImg > out {
		return pricing.Usage{}, false
	}
	if !u.Has("output_tokens_details.image_tokens") {
		outImg = out
	}
	return pricing.Usage{Prompt: in, Completion: out}.With(pricing.ImageInput, img).With(pricing.ImageOutput, outImg), true
}
