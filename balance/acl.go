package balance

import (
	"fmt"
	"strings"
)

// dataCommands are the commands a data-plane Store sends (DESIGN.md "Two planes"): the scripts
// (every write of the hot path is one), the few reads and deletes outside them, and what the
// client and New need (connection set-up, server checks, Cluster topology, SCAN). Redis checks
// every redis.call a script makes against the user's key patterns, so EVAL grants no more than
// the patterns do.
var dataCommands = []string{
	"+evalsha", "+eval", "+script|load", "+script|exists",
	// what the scripts call (Redis checks each redis.call against the user's commands too)
	"+hget", "+hmget", "+hset", "+hsetnx", "+hdel", "+hexists", "+hgetall", "+hvals", "+hincrby", "+hlen",
	"+zadd", "+zrem", "+zscore", "+zcard", "+zcount", "+zrange", "+zrangebyscore", "+zremrangebyscore",
	"+pexpire", "+set",
	"+sadd", // WantLimits: a data-plane store asks the admin plane for an org's limits
	"+spop", // the admin plane's ScanWarmOrgs takes that set (a data key)
	// what the Store sends outside scripts
	"+get", "+exists", "+hscan", "+del", "+scan", "+time",
	"+ping", "+echo", "+hello", "+auth", "+select", "+client|setname", "+client|id", "+command",
	"+info", "+config|get", "+cluster|slots", "+cluster|shards", "+cluster|nodes", "+cluster|info",
	"+readonly", "+readwrite", "+asking",
}

// ACLRules returns the two ACL SETUSER commands of a split deployment under prefix, one line
// each (DESIGN.md "Two planes"): the data user — the proxies — may run the scripts and the few
// commands a data-plane Store sends, read and write the data keys (dataPatterns) and only read
// the admin keys (adminPattern, "%R~": Redis ≥ 7.0); the admin user — the admin API — sends the
// same commands (SET, DEL and the push script are its writes of the admin keys) on every key
// under the prefix. The planes differ by keys, not by commands: a script's redis.call is checked
// against both. A user is reset first (its old rules dropped) and given no channels.
func ACLRules(prefix, dataUser, dataPassword, adminUser, adminPassword string) (data, admin string, err error) {
	if !validPrefix(prefix) {
		return "", "", fmt.Errorf("%w: prefix %q", ErrConfig, prefix)
	}
	for _, w := range []string{dataUser, dataPassword, adminUser, adminPassword} {
		if w == "" || len(w) > 128 || strings.ContainsAny(w, " \t\r\n\"'<>") {
			return "", "", fmt.Errorf("%w: redis acl user or password %q: 1 to 128 bytes, no space or quote", ErrConfig, w)
		}
	}
	if dataUser == adminUser {
		return "", "", fmt.Errorf("%w: the redis data and admin users must differ", ErrConfig)
	}
	var d []string
	for _, p := range dataPatterns(prefix) {
		d = append(d, "~"+p)
	}
	line := func(user, pass string, keys []string, cmds []string) string {
		parts := append([]string{"ACL", "SETUSER", user, "reset", "on", ">" + pass, "resetchannels", "-@all"}, cmds...)
		return strings.Join(append(parts, keys...), " ")
	}
	data = line(dataUser, dataPassword, append(d, "%R~"+adminPattern(prefix)), dataCommands)
	admin = line(adminUser, adminPassword, []string{"~" + prefix + ":*"}, dataCommands)
	return data, admin, nil
}
