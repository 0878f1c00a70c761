package testutil

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// ErrSSEIncomplete is returned by SDKStream for a stream that ends inside an event.
var ErrSSEIncomplete = errors.New("testutil: the stream ends inside an event")

// SDKStream decodes an event stream the way the OpenAI SDKs do (openai-python's SSEDecoder and
// Stream.__stream__, openai-node's Stream.fromSSEResponse): lines end with \n, \r\n or \r; a
// line starting with ':' (a comment) is skipped; a blank line dispatches the event only when it
// has a name or data; `data: [DONE]` ends the stream; every other dispatched event — whatever
// its name — reaches the SDK's caller as a JSON value (python: sse.json(), node: JSON.parse),
// so it must decode as one. It returns what the caller iterates over and whether [DONE] came.
func SDKStream(body string) (items []map[string]any, done bool, err error) {
	body = strings.ReplaceAll(strings.ReplaceAll(body, "\r\n", "\n"), "\r", "\n")
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(nil, 1<<26)
	var event string
	var data []string
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			if event == "" && len(data) == 0 {
				continue
			}
			d := strings.Join(data, "\n")
			event, data = "", nil
			if strings.HasPrefix(d, "[DONE]") {
				return items, true, nil
			}
			var v map[string]any
			if err := json.Unmarshal([]byte(d), &v); err != nil {
				return items, false, fmt.Errorf("testutil: the SDK cannot decode the event %q: %w", d, err)
			}
			items = append(items, v)
			continue
		}
		if line[0] == ':' {
			continue
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "event":
			event = value
		case "data":
			data = append(data, value)
		}
	}
	if err := sc.Err(); err != nil {
		return items, false, err
	}
	if len(data) > 0 || event != "" {
		return items, false, ErrSSEIncomplete
	}
	return items, false, nil
}

// CostComment finds escrow's cost comment in an event stream (`: escrow {"cost":…,"balance":…}`
// and the blank line after it, a block of its own): its bytes, the cost, and the balance (-1
// when left out). ok is false when there is none; err says what is wrong with one.
func CostComment(body string) (comment string, cost, bal int64, ok bool, err error) {
	const prefix = ": escrow "
	i := strings.Index(body, prefix)
	if i < 0 {
		return "", 0, 0, false, nil
	}
	if strings.Count(body, prefix) != 1 {
		return "", 0, 0, true, errors.New("testutil: more than one escrow comment")
	}
	end := strings.Index(body[i:], "\n\n")
	if end < 0 || (i > 0 && !strings.HasSuffix(body[:i], "\n\n")) {
		return "", 0, 0, true, errors.New("testutil: the escrow comment is not a block of its own")
	}
	comment = body[i : i+end+2]
	var v struct {
		Cost    *int64 `json:"cost"`
		Balance *int64 `json:"balance"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(comment[:len(comment)-2], prefix)), &v); err != nil || v.Cost == nil {
		return comment, 0, 0, true, fmt.Errorf("testutil: escrow comment %q: %v", comment, err)
	}
	bal = -1
	if v.Balance != nil {
		bal = *v.Balance
	}
	return comment, *v.Cost, bal, true, nil
}
