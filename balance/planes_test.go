package balance_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/lua"
)

// planeUsers creates the two planes' ACL users of env's prefix (balance.ACLRules, as `escrow
// redis-acl` prints them) on the real Redis, with names of their own, and returns a client of
// each.
func planeUsers(t *testing.T, env *testutil.RedisEnv) (data, admin *redis.Client) {
	t.Helper()
	d, a, err := balance.ACLRules(env.Prefix, testutil.RandomName("data"), testutil.RandomName("pw"), testutil.RandomName("admin"), testutil.RandomName("pw"))
	if err != nil {
		t.Fatal(err)
	}
	urls := testutil.RedisUsers(t, env, d, a)
	return testutil.RedisClientOf(t, urls[0]), testutil.RedisClientOf(t, urls[1])
}

// TestConformancePlanes runs the whole conformance suite with every store on the data user and
// its admin writes (the limits' push, revocations, model versions) on the admin user: every
// rule of the protocol holds with the split credentials.
func TestConformancePlanes(t *testing.T) {
	t.Parallel()
	env := testutil.RealRedis(t)
	data, admin := planeUsers(t, env)
	e := envOf(env)
	e.Data, e.Admin = data, admin
	balancetest.Run(t, e)
}

// TestDataUserCannotWriteAdminKeys: Redis checks every redis.call of a script against the
// user's key patterns, so the data user cannot write an admin-plane key even through EVAL — one
// subtest per kind of admin key. The same script as the admin user succeeds, and the data user
// writes its own keys through EVAL (the refusal is the key's plane, not the script).
func TestDataUserCannotWriteAdminKeys(t *testing.T) {
	t.Parallel()
	env := testutil.RealRedis(t)
	data, admin := planeUsers(t, env)
	ctx := context.Background()
	p := env.Prefix
	lim := balance.KeysOf(p, "acme").Lim
	for _, tc := range []struct {
		kind   string
		script string
		key    string
		args   []any
	}{
		{"freeze", "return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])", lim, []any{"fo", "1"}},
		{"unfreeze", "return redis.call('HDEL', KEYS[1], ARGV[1])", lim, []any{"fo"}},
		{"limit", "return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])", lim, []any{"o", "l1,day,999999999"}},
		{"limits dropped", "return redis.call('DEL', KEYS[1])", lim, nil},
		{"model version", "return redis.call('SET', KEYS[1], ARGV[1])", p + ":a:model:gpt-4o:ver", []any{"v2"}},
		{"ledger epoch", "return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])", lim, []any{"epoch", "9:restored"}},
		{"key revocation", "return redis.call('DEL', KEYS[1])", p + ":a:key:key_1:revoked", nil},
		{"key revocation set", "return redis.call('SET', KEYS[1], '1')", p + ":a:key:key_1:revoked", nil},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			if !strings.HasPrefix(tc.key, p+":a:") {
				t.Fatalf("%s is not an admin key", tc.key)
			}
			err := data.Eval(ctx, tc.script, []string{tc.key}, tc.args...).Err()
			if err == nil || !strings.HasPrefix(err.Error(), "NOPERM") {
				t.Fatalf("data user's EVAL on %s: %v, want NOPERM", tc.key, err)
			}
			if err := data.Get(ctx, tc.key).Err(); err != nil && !errors.Is(err, redis.Nil) && !strings.Contains(err.Error(), "WRONGTYPE") {
				t.Fatalf("data user reads %s: %v", tc.key, err)
			}
			if err := admin.Eval(ctx, tc.script, []string{tc.key}, tc.args...).Err(); err != nil && !errors.Is(err, redis.Nil) {
				t.Fatalf("admin user's EVAL on %s: %v", tc.key, err)
			}
		})
	}
	acct := balance.KeysOf(p, "acme").Acct
	if err := data.Eval(ctx, "return redis.call('HSET', KEYS[1], 'bal', '1')", []string{acct}).Err(); err != nil {
		t.Fatalf("data user's EVAL on its own key %s: %v", acct, err)
	}
	if err := data.Set(ctx, p+":a:model:m:ver", "x", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "NOPERM") {
		t.Fatalf("data user's SET of a model version: %v, want NOPERM", err)
	}
}

// TestDataOnlyStore: a store of the data plane only never writes an admin key (ErrDataPlane),
// and an org whose limits were never pushed stays cold (the proxy answers 503) until the
// admin plane pushes them; then it seeds and reserves. A store on the data user that believes it
// may push (no DataOnly, no Admin client) meets NOPERM, also answered cold.
func TestDataOnlyStore(t *testing.T) {
	t.Parallel()
	env := testutil.RealRedis(t)
	dataC, adminC := planeUsers(t, env)
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	l.Add("acme", 1_000, "")
	l.SetLimits("acme", balance.Limits{Frozen: []balance.Scope{{Kind: balance.ScopeKey, ID: "k9"}}})
	newStore := func(c redis.UniversalClient, cfg balance.Config) *balance.Store {
		cfg.Prefix, cfg.Ledger = env.Prefix, l
		s, err := balance.New(ctx, c, &cfg)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	data := newStore(dataC, balance.Config{DataOnly: true})
	naive := newStore(dataC, balance.Config{})
	adm := newStore(dataC, balance.Config{Admin: adminC})

	reserve := func(s *balance.Store, id string) error {
		_, err := s.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: id, Amount: 10, KeyID: "k1"})
		return err
	}
	noLimits := func(err error) bool {
		return errors.Is(err, balance.ErrCold) && strings.Contains(err.Error(), "limits are not pushed")
	}
	if err := reserve(data, "h1"); !noLimits(err) {
		t.Fatalf("data-only reserve before any push: %v, want ErrCold (limits not pushed)", err)
	}
	if err := reserve(naive, "h1"); !noLimits(err) || !strings.Contains(err.Error(), "NOPERM") || errors.Is(err, balance.ErrRedis) {
		t.Fatalf("reserve on the data user before any push: %v, want ErrCold (limits not pushed: NOPERM), not ErrRedis", err)
	}
	if n, err := env.Client.SCard(ctx, env.Prefix+":{!}:limwant").Result(); err != nil || n != 1 {
		t.Fatalf("the org is not asked for: %d %v", n, err)
	}
	if _, err := data.PushLimits(ctx, "acme", l.Limits("acme")); !errors.Is(err, balance.ErrConfig) {
		t.Fatalf("data-only push: %v, want ErrConfig", err)
	}
	for name, err := range map[string]error{
		"revoke":      data.RevokeKey(ctx, "k1"),
		"touch model": data.TouchModel(ctx, "m"),
		"model max":   data.SetModelMax(ctx, "m", 5),
	} {
		if !errors.Is(err, balance.ErrConfig) {
			t.Errorf("data-only %s: %v, want ErrConfig", name, err)
		}
	}
	// The admin plane's reconciler round takes the asked-for org (cold as it is); a data-only
	// store's round does not.
	var seen []string
	if err := data.ScanWarmOrgs(ctx, func(o string) error { seen = append(seen, o); return nil }); err != nil || len(seen) != 0 {
		t.Fatalf("data-only scan: %v %v", seen, err)
	}
	if err := adm.ScanWarmOrgs(ctx, func(o string) error { seen = append(seen, o); return nil }); err != nil || len(seen) != 1 || seen[0] != "acme" {
		t.Fatalf("admin scan: %v %v, want the asked-for org", seen, err)
	}
	if pushed, err := adm.PushLimits(ctx, "acme", l.Limits("acme")); err != nil || !pushed {
		t.Fatalf("admin push: %v %v", pushed, err)
	}
	if err := reserve(data, "h1"); err != nil {
		t.Fatalf("data-only reserve after the push: %v", err)
	}
	if _, err := data.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: "h2", Amount: 10, KeyID: "k9"}); !errors.Is(err, balance.ErrFrozen) {
		t.Fatalf("the pushed freeze: %v, want ErrFrozen", err)
	}
	// The admin plane's other writes, as the admin user.
	if err := adm.RevokeKey(ctx, "k1"); err != nil {
		t.Fatal(err)
	}
	if ok, err := data.KeyRevoked(ctx, "k1"); err != nil || !ok {
		t.Fatalf("revocation seen by the data plane: %v %v", ok, err)
	}
	if err := adm.TouchModel(ctx, "m"); err != nil {
		t.Fatal(err)
	}
}

// TestLimKeyAgrees: the scripts name lim from acct (lib/limits's lim_key) as KeysOf does, and
// every key of an org falls under its plane's pattern.
func TestLimKeyAgrees(t *testing.T) {
	env := testutil.MiniRedis(t)
	for _, prefix := range []string{"esc", "a", "my:ns", "esc:a"} {
		for _, org := range []string{"acme", "a", "o:1"} {
			k := balance.KeysOf(prefix, org)
			got, err := env.Client.Eval(context.Background(), lua.Lib+"\nreturn lim_key(KEYS[1])", []string{k.Acct}).Text()
			if err != nil || got != k.Lim {
				t.Fatalf("lim_key(%q) = %q %v, want %q", k.Acct, got, err, k.Lim)
			}
			// the patterns ACLRules gives the users
			d, a, err := balance.ACLRules(prefix, "d", "p", "a", "p")
			if err != nil {
				t.Fatal(err)
			}
			adminPat := strings.TrimPrefix(a[strings.LastIndex(a, " ")+1:], "~")
			dataPat := strings.Fields(d)[len(strings.Fields(d))-3][1:]
			if adminPat != prefix+":*" || !globMatch(strings.TrimPrefix(d[strings.LastIndex(d, " ")+1:], "%R~"), k.Lim) {
				t.Fatalf("%q not under the admin pattern of %q / %q", k.Lim, d, a)
			}
			for _, key := range []string{k.Acct, k.Holds, k.Hexp, k.Hfin, k.Gone, k.U} {
				if globMatch(strings.TrimPrefix(d[strings.LastIndex(d, " ")+1:], "%R~"), key) || !globMatch(dataPat, key) {
					t.Fatalf("%q is not a data key of prefix %q (%s)", key, prefix, d)
				}
			}
		}
	}
}

// globMatch is Redis's glob for patterns whose only special character is '*'.
func globMatch(pattern, s string) bool {
	parts := strings.Split(pattern, "*")
	if !strings.HasPrefix(s, parts[0]) {
		return false
	}
	s = s[len(parts[0]):]
	for i, p := range parts[1:] {
		if i == len(parts)-2 {
			return strings.HasSuffix(s, p)
		}
		j := strings.Index(s, p)
		if j < 0 {
			return false
		}
		s = s[j+len(p):]
	}
	return true
}
