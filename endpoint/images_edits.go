package endpoint

// ImagesEdits is OpenAI's image edits: a multipart/form-data upload (the image, an optional
// mask, the prompt) priced like generations, per image by size × quality × n (dall-e-2 style):
// the uploaded images are not billed by a per-image model. Token-billed models (gpt-image) are
// refused unless priced per image, as on generations.
var ImagesEdits = register(&Spec{
	Path:         "/v1/images/edits",
	Provider:     OpenAI,
	Billed:       true,
	NoOutput:     true,
	Multipart:    true,
	Prove:        proveImages,
	StatedFields: []string{"n", "size", "quality"},
	EndUserField: "user",
})
