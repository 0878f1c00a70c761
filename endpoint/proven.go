package endpoint

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
}

// Refusal is a request that its endpoint cannot price: a 400 invalid_request_error naming
// Param, nothing held.
type Refusal struct {
	Param   string
	Message string
}
