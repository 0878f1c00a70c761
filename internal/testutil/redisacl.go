package testutil

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisUsers creates ACL users on env's real Redis from ACL SETUSER lines (as
// balance.ACLRules prints them: "ACL SETUSER <user> … ><password> …"), deletes them when the
// test ends, and returns for each a URL of env's server that logs in as that user. Give each
// test user names of its own (RandomName): ACL users are server-wide.
func RedisUsers(tb testing.TB, env *RedisEnv, lines ...string) []string {
	tb.Helper()
	if !env.Real() {
		tb.Fatal("testutil.RedisUsers needs a real Redis (miniredis has no ACL)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	urls := make([]string, 0, len(lines))
	for _, line := range lines {
		f := strings.Fields(line)
		if len(f) < 3 || !strings.EqualFold(f[0], "ACL") || !strings.EqualFold(f[1], "SETUSER") {
			tb.Fatalf("not an ACL SETUSER line: %q", line)
		}
		user, pass := f[2], ""
		for _, w := range f[3:] {
			if p, ok := strings.CutPrefix(w, ">"); ok {
				pass = p
			}
		}
		args := make([]any, len(f))
		for i, w := range f {
			args[i] = w
		}
		if err := env.Client.Do(ctx, args...).Err(); err != nil {
			tb.Fatalf("%s: %v", line, err)
		}
		tb.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = env.Client.Do(ctx, "ACL", "DELUSER", user).Err()
		})
		u, err := url.Parse(env.URL)
		if err != nil {
			tb.Fatal(err)
		}
		u.User = url.UserPassword(user, pass)
		urls = append(urls, u.String())
	}
	return urls
}

// RedisClientOf is a client of a Redis URL, closed when the test ends.
func RedisClientOf(tb testing.TB, rawURL string) *redis.Client {
	tb.Helper()
	opt, err := redis.ParseURL(rawURL)
	if err != nil {
		tb.Fatal(err)
	}
	opt.PoolSize = 64
	c := redis.NewClient(opt)
	tb.Cleanup(func() { _ = c.Close() })
	return c
}
