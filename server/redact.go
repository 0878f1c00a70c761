package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strings"

	"github.com/llmescrow/escrow/ledger"
)

// redacted replaces a secret in a log line.
const redacted = "xxxxx"

// redact returns s with the secrets of every URL in it masked: the password of a userinfo
// (redis://user:pw@host → redis://user:xxxxx@host) and the value of every query parameter whose
// name looks like a credential (?password=, ?token=, ?api_key=, ?sig=, …), plus the password of a
// key=value connection string (PostgreSQL's "host=… password=…"), and every webhook signing
// secret (whsec_…). It is the one redaction rule:
// the server's logger applies it to every line (redactingHandler), and errors that leave New
// carry it (redactError), because configuration URLs (UPSTREAM_URL, REDIS_URL, DATABASE_URL) and
// the errors of the clients that dial them end up in log lines.
func redact(s string) string {
	if strings.Contains(s, "://") {
		var b strings.Builder
		rest := s
		for {
			i := strings.Index(rest, "://")
			if i < 0 {
				b.WriteString(rest)
				break
			}
			// The URL runs from its scheme to the next space, quote, bracket or comma (REDIS_URL
			// lists a Cluster's nodes with commas).
			start := i
			for start > 0 && isSchemeByte(rest[start-1]) {
				start--
			}
			end := i + 3
			for end < len(rest) && !strings.ContainsRune(" \t\r\n\"'`<>(),", rune(rest[end])) {
				end++
			}
			b.WriteString(rest[:start])
			b.WriteString(redactURL(rest[start:end]))
			rest = rest[end:]
		}
		s = b.String()
	}
	if dsnPassword.MatchString(s) {
		s = dsnPassword.ReplaceAllString(s, "${1}"+redacted)
	}
	if strings.Contains(s, ledger.SecretPrefix) {
		s = webhookSecret.ReplaceAllString(s, ledger.SecretPrefix+redacted)
	}
	return s
}

// webhookSecret is a webhook signing secret (ledger.SecretPrefix and its base64url).
var webhookSecret = regexp.MustCompile(regexp.QuoteMeta(ledger.SecretPrefix) + `[A-Za-z0-9_-]+`)

// dsnPassword is the password of a key=value connection string.
var dsnPassword = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&'"]+)`)

func isSchemeByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '+' || c == '-' || c == '.'
}

// redactURL masks one URL's secrets. It works on the text rather than through url.Parse, so a
// URL that does not parse (the very URL a configuration error is about) is masked too.
func redactURL(u string) string {
	i := strings.Index(u, "://")
	head, rest := u[:i+3], u[i+3:]
	authEnd := strings.IndexAny(rest, "/?#")
	if authEnd < 0 {
		authEnd = len(rest)
	}
	auth, tail := rest[:authEnd], rest[authEnd:]
	if at := strings.LastIndex(auth, "@"); at >= 0 {
		user := auth[:at]
		if c := strings.Index(user, ":"); c >= 0 {
			user = user[:c+1] + redacted
		}
		auth = user + "@" + auth[at+1:]
	}
	if q := strings.IndexByte(tail, '?'); q >= 0 {
		path, query := tail[:q+1], tail[q+1:]
		frag := ""
		if h := strings.IndexByte(query, '#'); h >= 0 {
			query, frag = query[:h], query[h:]
		}
		params := strings.Split(query, "&")
		for j, p := range params {
			if k, _, ok := strings.Cut(p, "="); ok && secretName(k) {
				params[j] = k + "=" + redacted
			}
		}
		tail = path + strings.Join(params, "&") + frag
	}
	return head + auth + tail
}

// secretName reports whether a query parameter's name looks like it holds a credential.
func secretName(k string) bool {
	k = strings.ToLower(k)
	for _, w := range []string{"pass", "pwd", "secret", "token", "key", "auth", "sig", "cred"} {
		if strings.Contains(k, w) {
			return true
		}
	}
	return false
}

// redactError keeps err (errors.Is/As still see it) but masks the secrets of its message.
func redactError(err error) error {
	if err == nil {
		return nil
	}
	var r *redactedError
	if errors.As(err, &r) {
		return err
	}
	return &redactedError{err: err, msg: redact(err.Error())}
}

type redactedError struct {
	err error
	msg string
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }

// redactingHandler applies redact to every log record's message and to its string, error and
// Stringer attributes (in groups too), so no log line of the server or of the parts it logs for
// carries a URL's password or token; it also masks every occurrence of the secrets it was given
// (the upstreams' keys, the admin token), wherever they appear.
type redactingHandler struct {
	next    slog.Handler
	secrets []string
}

// minSecret is the shortest secret masked by value: shorter ones would mask common words.
const minSecret = 4

// redactLogger returns l logging through a redactingHandler that also masks secrets (l itself
// if it already does and no secret is added).
func redactLogger(l *slog.Logger, secrets ...string) *slog.Logger {
	h, ok := l.Handler().(redactingHandler)
	if !ok {
		h = redactingHandler{next: l.Handler()}
	}
	added := false
	for _, s := range secrets {
		if len(s) >= minSecret && !slices.Contains(h.secrets, s) {
			h.secrets = append(slices.Clip(h.secrets), s)
			added = true
		}
	}
	if ok && !added {
		return l
	}
	return slog.New(h)
}

// redact is the package's redact plus the handler's secrets.
func (h redactingHandler) redact(s string) string {
	s = redact(s)
	for _, sec := range h.secrets {
		if strings.Contains(s, sec) {
			s = strings.ReplaceAll(s, sec, redacted)
		}
	}
	return s
}

func (h redactingHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.next.Enabled(ctx, l)
}

func (h redactingHandler) Handle(ctx context.Context, r slog.Record) error {
	out := slog.NewRecord(r.Time, r.Level, h.redact(r.Message), r.PC)
	r.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(h.redactAttr(a))
		return true
	})
	return h.next.Handle(ctx, out)
}

func (h redactingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	red := make([]slog.Attr, len(as))
	for i, a := range as {
		red[i] = h.redactAttr(a)
	}
	return redactingHandler{h.next.WithAttrs(red), h.secrets}
}

func (h redactingHandler) WithGroup(name string) slog.Handler {
	return redactingHandler{h.next.WithGroup(name), h.secrets}
}

func (h redactingHandler) redactAttr(a slog.Attr) slog.Attr {
	v := a.Value.Resolve()
	switch v.Kind() {
	case slog.KindString:
		return slog.String(a.Key, h.redact(v.String()))
	case slog.KindGroup:
		g := v.Group()
		red := make([]any, len(g))
		for i, x := range g {
			red[i] = h.redactAttr(x)
		}
		return slog.Group(a.Key, red...)
	case slog.KindAny:
		switch x := v.Any().(type) {
		case error:
			return slog.String(a.Key, h.redact(x.Error()))
		case fmt.Stringer:
			return slog.String(a.Key, h.redact(x.String()))
		}
	}
	return slog.Attr{Key: a.Key, Value: v}
}
