package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
)

func TestRedact(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ in, want string }{
		{"redis://default:hunter2@10.0.0.1:6379/0", "redis://default:xxxxx@10.0.0.1:6379/0"},
		{"rediss://:hunter2@cache:6380", "rediss://:xxxxx@cache:6380"},
		{"redis://u:p1@a:1,redis://u:p2@b:2", "redis://u:xxxxx@a:1,redis://u:xxxxx@b:2"},
		{"postgres://app:s3cr@t@db:5432/ledger?sslmode=require&password=other", "postgres://app:xxxxx@db:5432/ledger?sslmode=require&password=xxxxx"},
		{"https://api.example.com/v1?api-key=abc&Token=t&X-Amz-Signature=s&mode=fast#top", "https://api.example.com/v1?api-key=xxxxx&Token=xxxxx&X-Amz-Signature=xxxxx&mode=fast#top"},
		{"host=db user=app password='a b c' dbname=x", "host=db user=app password=xxxxx dbname=x"},
		{"host=db sslpassword=k password=plain", "host=db sslpassword=xxxxx password=xxxxx"},
		{`parse "redis://u:p%zz@h:1": invalid URL escape "%zz"`, `parse "redis://u:xxxxx@h:1": invalid URL escape "%zz"`},
		{`Post "http://op:pw@up:80/v1/chat/completions?token=tok": dial tcp: refused`, `Post "http://op:xxxxx@up:80/v1/chat/completions?token=xxxxx": dial tcp: refused`},
		{`webhook secret whsec_AbC-d_9 in "whsec_zz"`, `webhook secret whsec_xxxxx in "whsec_xxxxx"`},
		// Nothing secret: unchanged.
		{"https://api.openai.com", "https://api.openai.com"},
		{"redis://cache:6379/0 and postgres://app@db/x?sslmode=disable", "redis://cache:6379/0 and postgres://app@db/x?sslmode=disable"},
		{"password authentication failed for user \"app\"", "password authentication failed for user \"app\""},
		{"", ""},
	} {
		if got := redact(c.in); got != c.want {
			t.Errorf("redact(%q)\n got %q\nwant %q", c.in, got, c.want)
		}
		if got := redact(redact(c.in)); got != c.want {
			t.Errorf("redact twice of %q: %q", c.in, got)
		}
	}
}

// TestRedactingLogger: every string, error and Stringer attribute, in groups and in With, and
// the message are masked; other values pass unchanged.
func TestRedactingLogger(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := redactLogger(slog.New(slog.NewTextHandler(&buf, nil)))
	if redactLogger(l) != l {
		t.Fatal("a redacting logger was wrapped twice")
	}
	u, _ := url.Parse("https://op:pw-in-url@up.example/v1?key=k-in-query")
	l = l.With("base", "redis://:pw-in-with@r:1")
	l.WithGroup("g").Info("dial redis://:pw-in-msg@r:1 failed",
		"err", fmt.Errorf("wrapped: %w", errors.New("postgres://u:pw-in-err@db/x")),
		"url", u, "n", 42, slog.Group("inner", "dsn", "host=db password=pw-in-group"))
	out := buf.String()
	for _, secret := range []string{"pw-in-url", "k-in-query", "pw-in-with", "pw-in-msg", "pw-in-err", "pw-in-group"} {
		if strings.Contains(out, secret) {
			t.Errorf("log line carries %q: %s", secret, out)
		}
	}
	for _, kept := range []string{"up.example/v1", "n=42", "r:1", "db/x", "xxxxx"} {
		if !strings.Contains(out, kept) {
			t.Errorf("log line lost %q: %s", kept, out)
		}
	}
	if !l.Enabled(context.Background(), slog.LevelInfo) || l.Enabled(context.Background(), slog.LevelDebug) {
		t.Error("the redacting handler does not follow its handler's level")
	}
}

// TestRedactingLoggerSecrets: the secrets given (upstream keys, the admin token) are masked
// wherever they appear — message, attributes, With, groups, errors — also when added to a
// logger that already redacts; a secret too short to mask safely is left alone.
func TestRedactingLoggerSecrets(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	base := redactLogger(slog.New(slog.NewTextHandler(&buf, nil)))
	l := redactLogger(base, "sk-up-111", "adm-222", "k")
	if l == base || redactLogger(l, "sk-up-111") != l {
		t.Fatal("adding secrets: the logger was not replaced once")
	}
	l = redactLogger(l, "sk-up-333")
	l.With("hdr", "Bearer sk-up-111").WithGroup("g").Warn("key sk-up-333 refused",
		"err", errors.New("401 for adm-222"), slog.Group("inner", "k", "x-api-key: sk-up-333"), "word", "kept")
	out := buf.String()
	for _, secret := range []string{"sk-up-111", "adm-222", "sk-up-333"} {
		if strings.Contains(out, secret) {
			t.Errorf("log line carries %q: %s", secret, out)
		}
	}
	if strings.Count(out, redacted) != 4 || !strings.Contains(out, "word=kept") {
		t.Errorf("masked wrongly: %s", out)
	}
}

// TestRedactError: the message is masked, the chain still answers errors.Is.
func TestRedactError(t *testing.T) {
	t.Parallel()
	err := redactError(fmt.Errorf("%w: REDIS_URL: %w", ErrConfig, errors.New(`parse "redis://u:topsecret@h%": bad`)))
	if strings.Contains(err.Error(), "topsecret") || !errors.Is(err, ErrConfig) {
		t.Fatalf("redactError: %v (is ErrConfig: %v)", err, errors.Is(err, ErrConfig))
	}
	if redactError(nil) != nil {
		t.Fatal("redactError(nil) is not nil")
	}
}

// lockedBuffer is a log sink safe for the server's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestStartupLogRedacted (item 8): the proxy logs UPSTREAM_URL, REDIS_URL and DATABASE_URL at
// start, and the errors of a bad one, without their passwords and tokens.
func TestStartupLogRedacted(t *testing.T) {
	t.Parallel()
	env, pg := testutil.RealRedis(t), testutil.Postgres(t)
	up := httptest.NewServer(fakeupstream.New(fakeupstream.Options{KeepRequests: -1}))
	t.Cleanup(up.Close)
	withUser := func(raw, user, pw string) string {
		u, err := url.Parse(raw)
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.UserPassword(user, pw)
		return u.String()
	}
	var logs lockedBuffer
	cfg := DefaultConfig()
	cfg.Addr, cfg.Prefix = "127.0.0.1:0", env.Prefix
	// The default Redis user has no password and Postgres trusts local connections: both take
	// any password, so the URLs work and carry a secret.
	cfg.RedisURL = withUser(env.URL, "default", "redis-secret-1")
	cfg.DatabaseURL = withUser(pg.URL, "postgres", "pg-secret-2") + "&sslpassword=pg-secret-3"
	cfg.UpstreamURL = withUser(up.URL, "op", "up-secret-4") + "/?api_key=up-secret-5"
	cfg.UpstreamAPIKey = "sk-operator"
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	s, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	if !strings.Contains(out, "escrow proxy listening") || strings.Count(out, redacted) < 5 {
		t.Fatalf("start-up log without the masked URLs:\n%s", out)
	}
	for i := 1; i <= 5; i++ {
		if secret := fmt.Sprintf("secret-%d", i); strings.Contains(out, secret) {
			t.Errorf("the log carries %s:\n%s", secret, out)
		}
	}

	// A URL that does not parse: the error New returns does not quote its password.
	bad := DefaultConfig()
	bad.RedisURL, bad.DatabaseURL = "redis://u:redis-secret-6@h:1/%zz", "postgres://u:pg-secret-7@127.0.0.1:1/x"
	bad.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	_, err = New(context.Background(), bad)
	if err == nil || !errors.Is(err, ErrConfig) || strings.Contains(err.Error(), "secret-6") || strings.Contains(err.Error(), "secret-7") {
		t.Fatalf("New with a bad REDIS_URL: %v", err)
	}
	bad = DefaultConfig()
	bad.UpstreamURL, bad.UpstreamAPIKey = "op:up-secret-8@/no-scheme", "k"
	bad.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	if err := bad.validate(); err == nil {
		if _, err := New(context.Background(), bad, WithEmbeddedRedis(env.Client)); err == nil || strings.Contains(err.Error(), "secret-8") {
			t.Fatalf("New with a bad UPSTREAM_URL: %v", err)
		}
	}
}
