package lua_test

import (
	"io/fs"
	"regexp"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/lua"
)

// redis60 lists the commands the scripts may use: all exist, with the arguments used, in
// Redis 6.0. Commands added later (GETDEL, GETEX, ZADD GT/LT, ...) are deliberately absent.
var redis60 = map[string]bool{
	"TIME": true, "EXISTS": true, "DEL": true, "PEXPIRE": true, "GET": true, "SET": true,
	"HGET": true, "HMGET": true, "HSET": true, "HSETNX": true, "HSCAN": true, "HDEL": true, "HEXISTS": true, "HINCRBY": true,
	"HVALS": true, "HLEN": true, "HGETALL": true,
	"ZADD": true, "ZREM": true, "ZSCORE": true, "ZCOUNT": true, "ZCARD": true,
	"ZRANGE": true, "ZRANGEBYSCORE": true, "ZREMRANGEBYSCORE": true, // ZRANGE by index only (BYSCORE, REV, LIMIT are 6.2)
}

// banned words that must not appear as arguments either (options added after 6.0).
// (matched in a call's arguments, after its command)
var bannedArgs = regexp.MustCompile(`,\s*['"](GT|LT|GETDEL|GETEX|PXAT|EXAT|KEEPTTL|GET|BYSCORE|BYLEX|REV)['"]\s*[,)]`)

var callRe = regexp.MustCompile(`redis\.p?call\(\s*(['"]?)([A-Za-z_.\[\]0-9]*)(['"]?)`)

func scripts(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := fs.WalkDir(lua.FS, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := lua.FS.ReadFile(path)
		out[path] = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	out["lib/limits.lua"] = lua.Lib // the shared prelude is checked like a script
	return out
}

// TestRedis60Commands fails on any command outside the Redis 6.0 allow-list, and on any call
// whose command is not a literal (it could not be checked).
func TestRedis60Commands(t *testing.T) {
	all := scripts(t)
	if len(all) < 10 { // every exported source (TestSourcesExposed)
		t.Fatalf("only %d scripts embedded", len(all))
	}
	for name, src := range all {
		calls := callRe.FindAllStringSubmatch(src, -1)
		if len(calls) == 0 && name != "" {
			t.Errorf("%s: no redis.call found", name)
		}
		for _, m := range calls {
			if m[1] == "" || m[3] == "" {
				t.Errorf("%s: command is not a literal: %s", name, m[0])
				continue
			}
			if cmd := strings.ToUpper(m[2]); !redis60[cmd] {
				t.Errorf("%s: %s is not on the Redis 6.0 allow-list", name, cmd)
			}
		}
		for _, line := range strings.Split(src, "\n") {
			code, _, _ := strings.Cut(line, "--")
			if strings.Contains(code, "redis.call") && bannedArgs.MatchString(strings.ToUpper(code)) {
				t.Errorf("%s: option newer than 6.0: %s", name, strings.TrimSpace(code))
			}
		}
	}
}

// TestAllowListCatches proves the checker fails on a newer command.
func TestAllowListCatches(t *testing.T) {
	src := `local v = redis.call('GETDEL', KEYS[1]) redis.call("ZADD", KEYS[2], 'GT', 1, 'x')`
	var bad []string
	for _, m := range callRe.FindAllStringSubmatch(src, -1) {
		if !redis60[strings.ToUpper(m[2])] {
			bad = append(bad, m[2])
		}
	}
	if len(bad) != 1 || bad[0] != "GETDEL" {
		t.Fatalf("checker found %v", bad)
	}
	if !bannedArgs.MatchString(strings.ToUpper(src)) {
		t.Fatal("checker missed ZADD GT")
	}
}

// TestSourcesExposed: every exported source is one embedded file.
func TestSourcesExposed(t *testing.T) {
	all := scripts(t)
	withLib := map[string]bool{"reserve.lua": true, "settle.lua": true, "release.lua": true, "finish.lua": true, "reap.lua": true, "seed.lua": true}
	for name, src := range map[string]string{
		"reserve.lua": lua.Reserve, "settle.lua": lua.Settle, "release.lua": lua.Release, "finish.lua": lua.Finish,
		"reap.lua": lua.Reap, "expired.lua": lua.Expired, "extend.lua": lua.Extend,
		"unpin.lua": lua.Unpin, "seed.lua": lua.Seed, "push_limits.lua": lua.PushLimits,
		"state.lua": lua.State, "raise_model_max.lua": lua.RaiseModelMax,
		"model_use.lua": lua.ModelUse,
	} {
		want := all[name]
		if withLib[name] {
			want = lua.Lib + want
		}
		if src == "" || all[name] == "" || src != want {
			t.Errorf("%s not exposed", name)
		}
	}
}

// TestNoComputedNumberFormatted flags the two ways a script formats a number by itself with
// %.14g: tostring() and string concatenation. The right operand of every ".." must be a string
// literal, an ARGV string, a string Redis returned or an argument string (named v or v_<name>),
// or ms_string(...) (lib/limits: a whole ms timestamp below 10^14, formatted with %d); the only
// other exceptions are two millisecond timestamps (now ± a duration, ~1.7e12, exact under %.14g). Numbers passed
// to redis.call are checked at run time by the exactness test on a real Redis.
func TestNoComputedNumberFormatted(t *testing.T) {
	timestamp := map[string]string{
		"expired.lua": "'(' .. (now - tonumber(ARGV[1]))",
		"state.lua":   "'(' .. (now + tonumber(ARGV[1]))",
	}
	okOperand := regexp.MustCompile(`^\s*('|"|ARGV\[|v\b|v_\w+\b|ms_string\()`)
	for name, src := range scripts(t) {
		for _, line := range strings.Split(src, "\n") {
			code, _, _ := strings.Cut(line, "--")
			if strings.Contains(code, "tostring(") && !strings.Contains(code, "error_reply") {
				t.Errorf("%s: tostring of a value: %s", name, strings.TrimSpace(code))
			}
			if strings.Contains(code, "error_reply") {
				continue // an error message, never a value
			}
			if ts, ok := timestamp[name]; ok && strings.Contains(code, ts) {
				code = strings.Replace(code, ts, "", 1)
			}
			for _, rest := range strings.Split(code, "..")[1:] {
				if !okOperand.MatchString(rest) {
					t.Errorf("%s: concatenates a computed value: %s", name, strings.TrimSpace(line))
				}
			}
		}
	}
}
