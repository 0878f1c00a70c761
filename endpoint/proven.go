package endpoint

import "github.com/llmescrow/escrow/pricing"

// Stated is what a body of a proven endpoint (Spec.Prove) states that fixes its price.
type Stated struct {
	Model   string
	N       int64  // the choices asked for (n); 0 when absent
	Size    string // images: "1024x1024"; "" when absent
	Quality string // images: "standard", "hd", "low" …; "" when absent
	// Chars is the number of characters (Unicode code points) of the text input (speech's
	// input), after JSON unescaping.
	Chars int64
	// HasInput: the text input was sent as a string.
	HasInput bool
	// Audio is the uploaded audio file (transcriptions), nil when none was sent.
	Audio []byte

	// Prices are the model's prices (nil when not yet known: a body is first read without
	// them, then proven again with them before the hold). They choose how a request is billed:
	// a gpt-image model (an image_output price) by tokens, a dall-e one per image.
	Prices pricing.Prices
	// TextBytes are the bytes of the body that can be text input tokens (a JSON body whole; the
	// form fields of a multipart one that are no files).
	TextBytes int64
	// Files is the number of files a multipart body uploads.
	Files int64
	// Stream: the body asks for an event stream. PartialImages is images' partial_images.
	Stream        bool
	PartialImages int64
	// ImageTokens is the model's own max input tokens of one image (0: the spec's default).
	ImageTokens int64
	// ImageOutputTokens is the model's own max output tokens of one generated image, at any
	// size and quality (0: the published table, ImageOutputTokens).
	ImageOutputTokens int64
	// MaxOutputTokens is the model's max output tokens (0: unknown).
	MaxOutputTokens int64
}

// UsageObject is the usage object of an answer as the middleware reads it: names matched as a
// client's decoder matches them.
type UsageObject interface {
	// Count is the count at a dotted path ("input_tokens_details.image_tokens"): ok is false
	// when it is not a valid count, or absent and required.
	Count(path string, required bool) (n int64, ok bool)
	// Has reports whether the path is present and not null.
	Has(path string) bool
	// String is the string at a dotted path, "" when absent or not a string.
	String(path string) string
	// Ceil is the non-negative number at a dotted path rounded up (seconds); ok is false when
	// it is absent or not such a number.
	Ceil(path string) (n int64, ok bool)
}

// Refusal is a request that its endpoint cannot price: a 400 invalid_request_error naming
// Param, nothing held.
type Refusal struct {
	Param   string
	Message string
}
