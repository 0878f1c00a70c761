package balancetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// atMinute is a store config whose limit clock reads the first instant of a minute (give or
// take the test's run time), so that a test of a per-minute limit stays in one window.
func atMinute(t *testing.T, env Env, at time.Time) balance.Config {
	t.Helper()
	now, err := env.Client.Time(context.Background()).Result()
	if err != nil {
		t.Fatalf("TIME: %v", err)
	}
	return balance.Config{ClockOffset: at.Sub(now), MaxInFlight: 5000}
}

// unitLimit is a limit of scope s counting unit u.
func unitLimit(id string, s balance.Scope, w balance.Window, cap int64, u balance.Unit) balance.Limit {
	return balance.Limit{ID: id, Scope: s, Window: w, Cap: cap, Unit: u}
}

func keyScope(k string) balance.Scope { return balance.Scope{Kind: balance.ScopeKey, ID: k} }

// reserveTok reserves amount and a token bound of tokens for key through s.
func (x *h) reserveTok(s *balance.Store, id, key string, amount, tokens int64) (balance.Reservation, error) {
	return s.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: id, Amount: amount, KeyID: key, Tokens: tokens})
}

func (x *h) mustReserveTok(s *balance.Store, id, key string, amount, tokens int64) balance.Reservation {
	x.t.Helper()
	r, err := x.reserveTok(s, id, key, amount, tokens)
	if err != nil {
		x.t.Fatalf("reserve %s key %s %d (%d tokens): %v", id, key, amount, tokens, err)
	}
	x.counters()
	return r
}

// settleTok records the usage of hold id (cost and tokens, attributed to key at its reserve
// time) and settles it.
func (x *h) settleTok(id, key string, cost, tokens int64, at time.Time) balance.SettleStatus {
	x.t.Helper()
	e := x.l.AddUsageTokens(x.org, cost, tokens, id, key, x.l.Limits(x.org).Projects[key], at)
	st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e})
	if err != nil {
		x.t.Fatalf("settle %s: %v", id, err)
	}
	x.counters()
	return st[0]
}

// "Unit requests": a request counts 1 at reserve and gives it back when it fails (release,
// reap); finish and settle keep its 1 (the hold's 1 leaves, the entry's comes in). The
// reservation names the requests limit with the least left (x-ratelimit-*), and a refusal is a
// *LimitError of unit Requests for 1, writing nothing.
func exerciseRequestsLimit(t *testing.T, env Env) {
	t.Parallel()
	now := time.Date(2030, 7, 1, 9, 30, 0, 0, time.UTC)
	x := limited(t, env, atMinute(t, env, now), 1_000_000, balance.Limits{Limits: []balance.Limit{
		unitLimit("rpm", keyScope("k1"), balance.Minute, 3, balance.Requests),
		unitLimit("rpd", balance.Scope{Kind: balance.ScopeOrg}, balance.Day, 100, balance.Requests),
	}})
	f := func() int64 { return x.u()[field("rpm", balance.Minute.StartMS(now))] }
	ra := x.mustReserveTok(x.s, "a", "k1", 1_000, 0)
	eq(t, "a's minute", balance.Minute.StartMS(ra.ReservedAt), now.UnixMilli())
	eq(t, "a's rate cap", ra.RequestRate.Cap, 3)
	eq(t, "a's remaining", ra.RequestRate.Remaining, 2)
	_, next := balance.Minute.Bounds(ra.ReservedAt)
	eq(t, "a's reset", ra.RequestRate.ResetsAt, next)
	eq(t, "no tokens limit", ra.TokenRate, balance.RateInfo{})
	rb := x.mustReserveTok(x.s, "b", "k1", 1_000, 0)
	x.mustReserveTok(x.s, "c", "k1", 1_000, 0)
	eq(t, "three requests held", f(), 3)
	before := x.state()
	_, err := x.reserveTok(x.s, "d", "k1", 1_000, 0)
	var le *balance.LimitError
	if !errors.As(err, &le) {
		t.Fatalf("fourth request: %v, want a limit", err)
	}
	eq(t, "refusal unit", le.Limit.Unit, balance.Requests)
	eq(t, "refusal needs", le.Amount, 1)
	eq(t, "refusal used", le.Used, 3)
	eq(t, "refusal cap", le.Limit.Cap, 3)
	eq(t, "refusal window", le.Limit.Window, balance.Minute)
	if at := balance.Minute.StartMS(le.At); at != now.UnixMilli() || !le.ResetsAt.After(le.At) {
		t.Fatalf("refused at %v (resets %v): want the script's reserve time, in the minute of %v", le.At, le.ResetsAt, now)
	}
	eq(t, "refused: balance untouched", x.state().Balance, before.Balance)
	eq(t, "refused: counter untouched", f(), 3)
	// A failed request gives its 1 back.
	if ok, err := x.s.Release(x.ctx, x.org, "c"); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	eq(t, "released", f(), 2)
	x.counters()
	// A finished request keeps its 1; its settle moves the hold's 1 out and the entry's in.
	if ok, err := x.s.FinishBatch(x.ctx, []balance.Finish{{Org: x.org, HoldID: "a", Cost: 400, Tokens: 90}}); ok != 1 || err != nil {
		t.Fatalf("finish: %v %v", ok, err)
	}
	eq(t, "finished", f(), 2)
	x.counters()
	eq(t, "settle a", x.settleTok("a", "k1", 400, 90, ra.ReservedAt), balance.Applied)
	eq(t, "settle b (not finished)", x.settleTok("b", "k1", 700, 120, rb.ReservedAt), balance.Applied)
	eq(t, "settled", f(), 2)
	eq(t, "org day counter", x.u()[field("rpd", balance.Day.StartMS(now))], 2)
	rd := x.mustReserveTok(x.s, "d", "k1", 1_000, 0)
	eq(t, "last one of the minute", rd.RequestRate.Remaining, 0)
	if _, err := x.reserveTok(x.s, "e", "k1", 1_000, 0); !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("past the cap again: %v", err)
	}
}

// "Unit tokens": held at the request's token bound, finished and settled to the real count,
// like money; a refusal tells the tokens room (what fit can use) and writes nothing.
func exerciseTokensLimit(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		unitLimit("tpd", keyScope("k1"), balance.Day, 1_000, balance.Tokens),
	}})
	f := func() int64 { return x.u()[field("tpd", balance.Day.StartMS(x.redisNow()))] }
	ra := x.mustReserveTok(x.s, "a", "k1", 5_000, 400)
	eq(t, "tokens held", f(), 400)
	eq(t, "token rate cap", ra.TokenRate.Cap, 1_000)
	eq(t, "token rate remaining", ra.TokenRate.Remaining, 600)
	_, err := x.reserveTok(x.s, "b", "k1", 5_000, 700)
	var le *balance.LimitError
	if !errors.As(err, &le) {
		t.Fatalf("over the tokens cap: %v", err)
	}
	eq(t, "unit", le.Limit.Unit, balance.Tokens)
	eq(t, "needs", le.Amount, 700)
	eq(t, "used", le.Used, 400)
	eq(t, "token room known", le.HaveTokenRoom, true)
	eq(t, "token room", le.TokenRoom, 600)
	eq(t, "money room: the balance", le.Room, 1_000_000-5_000)
	eq(t, "refused: counter untouched", f(), 400)
	// Finish with the real count gives the unused tokens back at once.
	if n, err := x.s.FinishBatch(x.ctx, []balance.Finish{{Org: x.org, HoldID: "a", Cost: 1_200, Tokens: 150}}); n != 1 || err != nil {
		t.Fatalf("finish: %d %v", n, err)
	}
	eq(t, "finished to its real count", f(), 150)
	x.counters()
	rb := x.mustReserveTok(x.s, "b", "k1", 5_000, 700)
	eq(t, "b held", f(), 850)
	eq(t, "settle a (finished)", x.settleTok("a", "k1", 1_200, 150, ra.ReservedAt), balance.Applied)
	eq(t, "a's settle changes nothing", f(), 850)
	eq(t, "settle b above its token hold (overshoot)", x.settleTok("b", "k1", 6_000, 900, rb.ReservedAt), balance.Applied)
	eq(t, "b charged its real count", f(), 1_050)
	if _, err := x.reserveTok(x.s, "c", "k1", 10, 1); !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("past the cap after an overshoot: %v", err)
	}
	// A request with no token bound holds 0 tokens: a tokens limit at its cap still refuses
	// it only when the counter is past the cap, as here.
	rc, err := x.reserveTok(x.s, "c", "k2", 10, 0)
	if err != nil {
		t.Fatalf("another key is not in scope: %v", err)
	}
	eq(t, "other key: no token rate", rc.TokenRate, balance.RateInfo{})
}

// "All or nothing": with a money, a requests and a tokens limit in scope, a refusal by any one
// of them writes nothing to any counter or the balance.
func exerciseUnitsAllOrNothing(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		keyLimit("money", "k1", balance.Day, 10_000),
		unitLimit("req", keyScope("k1"), balance.Day, 2, balance.Requests),
		unitLimit("tok", keyScope("k1"), balance.Day, 500, balance.Tokens),
	}})
	day := func(id string) int64 { return x.u()[field(id, balance.Day.StartMS(x.redisNow()))] }
	x.mustReserveTok(x.s, "a", "k1", 4_000, 200)
	for _, c := range []struct {
		name           string
		amount, tokens int64
		unit           balance.Unit
	}{
		{"money", 6_001, 10, balance.Money},
		{"tokens", 100, 301, balance.Tokens},
	} {
		before := x.state()
		_, err := x.reserveTok(x.s, "x-"+c.name, "k1", c.amount, c.tokens)
		var le *balance.LimitError
		if !errors.As(err, &le) || le.Limit.Unit != c.unit {
			t.Fatalf("%s: %v, want a %s limit", c.name, err, c.unit)
		}
		eq(t, c.name+": balance", x.state().Balance, before.Balance)
		eq(t, c.name+": money", day("money"), 4_000)
		eq(t, c.name+": requests", day("req"), 1)
		eq(t, c.name+": tokens", day("tok"), 200)
	}
	x.mustReserveTok(x.s, "b", "k1", 6_000, 300) // exactly every cap
	_, err := x.reserveTok(x.s, "c", "k1", 1, 0)
	var le *balance.LimitError
	if !errors.As(err, &le) {
		t.Fatalf("third request: %v", err)
	}
	// Every cap is reached; the first limit in scope that refuses is reported.
	if le.Limit.Unit != balance.Money && le.Limit.Unit != balance.Requests {
		t.Fatalf("third request refused by %s", le.Limit.Unit)
	}
	eq(t, "requests", day("req"), 2)
	x.counters()
}

// "The seed's rebuild holds per unit": after the hot state is dropped, the seed counts the
// ledger's entries of the window in each limit's unit plus the live holds (a finished one at
// its real tokens).
func exerciseUnitsSeedRebuild(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		keyLimit("money", "k1", balance.Day, 100_000),
		unitLimit("req", keyScope("k1"), balance.Day, 100, balance.Requests),
		unitLimit("tok", keyScope("k1"), balance.Day, 100_000, balance.Tokens),
	}})
	day := func(id string) int64 { return x.u()[field(id, balance.Day.StartMS(x.redisNow()))] }
	ra := x.mustReserveTok(x.s, "a", "k1", 1_000, 300)
	x.mustReserveTok(x.s, "b", "k1", 2_000, 500)
	x.mustReserveTok(x.s, "c", "k1", 3_000, 700)
	eq(t, "settle a", x.settleTok("a", "k1", 800, 250, ra.ReservedAt), balance.Applied)
	if n, err := x.s.FinishBatch(x.ctx, []balance.Finish{{Org: x.org, HoldID: "b", Cost: 1_500, Tokens: 410}}); n != 1 || err != nil {
		t.Fatalf("finish b: %d %v", n, err)
	}
	x.l.AddUsageTokens(x.org, 99, 77, "old", "k1", "", ra.ReservedAt.Add(-48*time.Hour)) // another day's
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "money rebuilt", day("money"), 800+1_500+3_000)
	eq(t, "requests rebuilt", day("req"), 3)
	eq(t, "tokens rebuilt", day("tok"), 250+410+700)
	x.counters()
	if ok, err := x.s.Release(x.ctx, x.org, "c"); !ok || err != nil {
		t.Fatalf("release c: %v %v", ok, err)
	}
	eq(t, "requests after the release", day("req"), 2)
	eq(t, "tokens after the release", day("tok"), 250+410)
	x.counters()
}

// "A new or changed limit counts the live holds its scope and window cover", per unit: a
// requests and a tokens limit created while holds are in flight count them (1 each, their token
// holds), and their settle and release move those counters.
func exerciseNewUnitLimitCountsHoldsInFlight(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{})
	ra := x.mustReserveTok(x.s, "a", "k1", 1_000, 300)
	x.mustReserveTok(x.s, "b", "k1", 1_000, 200)
	lim := x.l.Limits(x.org)
	lim.Limits = []balance.Limit{
		unitLimit("req", keyScope("k1"), balance.Hour, 3, balance.Requests),
		unitLimit("tok", keyScope("k1"), balance.Hour, 1_000, balance.Tokens),
	}
	v := x.l.SetLimits(x.org, lim)
	if pushed, err := x.pushLimits(v); err != nil || !pushed {
		t.Fatalf("push: %v %v", pushed, err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	hour := func(id string) int64 { return x.u()[field(id, balance.Hour.StartMS(x.redisNow()))] }
	eq(t, "requests in flight counted", hour("req"), 2)
	eq(t, "tokens in flight counted", hour("tok"), 500)
	x.counters()
	if _, err := x.reserveTok(x.s, "c", "k1", 1_000, 501); !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("past the new tokens cap: %v", err)
	}
	eq(t, "settle a", x.settleTok("a", "k1", 900, 280, ra.ReservedAt), balance.Applied)
	eq(t, "requests after a's settle", hour("req"), 2)
	eq(t, "tokens after a's settle", hour("tok"), 480)
	if ok, err := x.s.Release(x.ctx, x.org, "b"); !ok || err != nil {
		t.Fatalf("release b: %v %v", ok, err)
	}
	eq(t, "requests after b's release", hour("req"), 1)
	eq(t, "tokens after b's release", hour("tok"), 280)
	x.counters()
}

// 2,000 concurrent reserves on one key limited to N requests per minute (the limit clock set
// to the start of a minute, so the burst stays in it): exactly N pass, the rest are refused by
// that limit, and the counter is N.
func exerciseBurst2000RequestsPerMinute(t *testing.T, env Env) {
	t.Parallel()
	const requests, n = 2000, 61
	env.Client = roomyClient(t, env.Client)           // env is this function's copy
	at := time.Date(2031, 3, 4, 5, 6, 0, 0, time.UTC) // a minute's first instant
	x := limited(t, env, atMinute(t, env, at), 1_000_000_000, balance.Limits{Limits: []balance.Limit{
		unitLimit("rpm", keyScope("k1"), balance.Minute, n, balance.Requests),
	}})
	s := x.s
	granted, refused := x.burst(requests, func(id string) (balance.Reservation, error) { return x.reserveTok(s, id, "k1", 1_000, 0) },
		func(err error) bool {
			var le *balance.LimitError
			return errors.As(err, &le) && le.Limit.Unit == balance.Requests
		})
	eq(t, "granted", granted, n)
	eq(t, "refused by the requests limit", refused, requests-n)
	c, err := s.Counters(x.ctx, x.org)
	if err != nil {
		t.Fatal(err)
	}
	eq(t, "counter", c[balance.Counter{LimitID: "rpm", Start: at.UnixMilli()}], n)
	eq(t, "balance", x.state().Balance, 1_000_000_000-n*1_000)
	x.counters()
}
