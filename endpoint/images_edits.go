package endpoint

// ImagesEdits is OpenAI's image edits: a multipart/form-data upload (the image or images, an
// optional mask, the prompt) billed like generations — per image by size × quality × n
// (dall-e-2 style: the uploads are not billed), or by tokens for a gpt-image model, whose
// bound counts each uploaded file as an input image at its max (proveImageTokens).
var ImagesEdits = register(&Spec{
	Path:         "/v1/images/edits",
	Provider:     OpenAI,
	Billed:       true,
	NoOutput:     true,
	Multipart:    true,
	Prove:        proveImages,
	Usage:        ImageUsage,
	StatedFields: []string{"n", "size", "quality", "partial_images"},
	EndUserField: "user",
})
