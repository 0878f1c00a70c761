package endpoint

// Moderations is OpenAI's moderations: free upstream and free here. A request is
// authenticated, attributed (a usage event of cost 0 under its model) and counted by request
// limits (a requests limit refuses it), with a zero hold: nothing is held for money, and its
// model needs no price. Its input is not read (text, images: all free).
var Moderations = register(&Spec{
	Path:         "/v1/moderations",
	Provider:     OpenAI,
	Billed:       true,
	Free:         true,
	NoOutput:     true,
	DefaultModel: "omni-moderation-latest",
	StatedFields: []string{"input"},
	EndUserField: "user",
})
