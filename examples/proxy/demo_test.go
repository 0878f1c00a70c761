package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestDemoCurlLine runs the proxy binary the way a newcomer does (no Redis, no Postgres, no
// upstream key), reads the curl lines it prints (OpenAI chat and Anthropic messages), and sends
// exactly those requests.
func TestDemoCurlLine(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "proxy")
	build := exec.Command("go", "build", "-o", bin, ".")
	// CGO_ENABLED=0, as make's non-race steps (go vet, the simulation, the model check) and the
	// image build: one build configuration, compiled once on an empty build cache.
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	// A bare machine: none of the proxy's variables set.
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); !strings.HasPrefix(k, "ESCROW_") && k != "REDIS_URL" && k != "DATABASE_URL" && !strings.HasPrefix(k, "UPSTREAM_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "ESCROW_ADDR=127.0.0.1:0")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Signal(os.Interrupt); _ = cmd.Wait() }()

	// The banner: "curl -s URL -H 'Authorization: Bearer KEY' -H '…' \" then "-d '{…}'" for chat,
	// the same with -H 'x-api-key: KEY' for messages, then the admin API's curl line.
	sc := bufio.NewScanner(stdout)
	curls := map[string][]string{}
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "curl -s ") && strings.Contains(line, "/admin/v1/") {
			break
		}
		for _, path := range []string{"/v1/chat/completions", "/v1/messages"} {
			if strings.HasPrefix(line, "curl -s ") && strings.Contains(line, path+" ") {
				curls[path] = append(curls[path], strings.TrimSuffix(line, "\\"))
				if sc.Scan() {
					curls[path] = append(curls[path], strings.TrimSpace(sc.Text()))
				}
			}
		}
	}
	curl := curls["/v1/chat/completions"]
	if len(curl) != 2 {
		t.Fatalf("no curl line in the demo banner (scan error %v)", sc.Err())
	}
	m := regexp.MustCompile(`curl -s (\S+) -H 'Authorization: Bearer (\S+)'`).FindStringSubmatch(curl[0])
	d := regexp.MustCompile(`-d '(.*)'$`).FindStringSubmatch(curl[1])
	if m == nil || d == nil {
		t.Fatalf("unexpected curl line: %q", curl)
	}
	demoMessages(t, ctx, curls["/v1/messages"])
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, m[1], strings.NewReader(d[1]))
	req.Header.Set("Authorization", "Bearer "+m[2])
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Choices []struct{ Message struct{ Content string } }
		Usage   struct{ PromptTokens, CompletionTokens int64 } `json:"usage"`
	}
	raw, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(raw, &body); err != nil || resp.StatusCode != 200 || len(body.Choices) != 1 {
		t.Fatalf("the demo's curl request: %d %s", resp.StatusCode, raw)
	}
	if resp.Header.Get("x-request-id") == "" || resp.Header.Get("x-escrow-cost") == "" || resp.Header.Get("x-escrow-balance") == "" {
		t.Fatalf("missing escrow headers: %v", resp.Header)
	}
}

// demoMessages sends the banner's Anthropic curl line and checks the reply is a billed message.
func demoMessages(t *testing.T, ctx context.Context, curl []string) {
	t.Helper()
	if len(curl) != 2 {
		t.Fatalf("no /v1/messages curl line in the demo banner: %q", curl)
	}
	m := regexp.MustCompile(`curl -s (\S+) -H 'x-api-key: (\S+)' -H 'anthropic-version: (\S+)'`).FindStringSubmatch(curl[0])
	d := regexp.MustCompile(`-d '(.*)'$`).FindStringSubmatch(curl[1])
	if m == nil || d == nil {
		t.Fatalf("unexpected curl line: %q", curl)
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, m[1], strings.NewReader(d[1]))
	req.Header.Set("x-api-key", m[2])
	req.Header.Set("anthropic-version", m[3])
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var body struct {
		Type  string
		Usage struct {
			Output int64 `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(raw, &body); err != nil || resp.StatusCode != 200 || body.Type != "message" || body.Usage.Output != 20 { // the fake answers 20 words, within max_tokens 50
		t.Fatalf("the demo's messages curl request: %d %s", resp.StatusCode, raw)
	}
	if resp.Header.Get("x-request-id") == "" || resp.Header.Get("x-escrow-hold-id") == "" {
		t.Fatalf("missing escrow headers: %v", resp.Header)
	}
}
