package balance

import "strings"

// OrgKeys are the Redis keys of one org's hot state (DESIGN.md "Redis keys"; the package
// documentation says what each holds). The org is the hash tag, so all of an org's keys are on
// one Cluster slot and one script may touch them together. The keys fall in two planes (DESIGN.md
// "Two planes"), told apart by pattern so that a Redis ACL user can be given one and only read the
// other (ACLRules):
//
//	data  "<prefix>:{<org>}:<kind>"     acct, holds, hexp, hfin, gone, u
//	admin "<prefix>:a:{<org>}:<kind>"   lim
//
// KeysOf is the one place this layout is written; the Store and every tool that reads or writes
// Redis directly (tests, the bench) take the names from it.
type OrgKeys struct {
	Acct  string // hash: bal, wm, epoch, lv
	Holds string // hash: hold id → record
	Hexp  string // zset: unfinished hold id → expiry (ms)
	Hfin  string // zset: finished hold id → expiry (ms)
	Gone  string // zset: tombstones of ended hold ids → time (ms)
	Lim   string // admin plane. hash: limits, freezes, key → project, version v, ledger epoch
	U     string // hash: window counters
}

// adminPlane is the segment after the prefix that puts a key in the admin plane.
const adminPlane = ":a"

// orgKinds are the key kinds, in the order keysOf fills OrgKeys's fields; admin marks the kinds
// of the admin plane.
var orgKinds = [...]struct {
	kind  string
	admin bool
}{{"acct", false}, {"holds", false}, {"hexp", false}, {"hfin", false}, {"gone", false}, {"lim", true}, {"u", false}}

// KeysOf returns the names of org's keys under prefix (Config.Prefix; DefaultPrefix unless
// set). It checks neither; the Store calls it only with a valid org.
func KeysOf(prefix, org string) OrgKeys {
	var k OrgKeys
	dst := [len(orgKinds)]*string{&k.Acct, &k.Holds, &k.Hexp, &k.Hfin, &k.Gone, &k.Lim, &k.U}
	// One allocation for all of them: each name is a substring of it.
	var b strings.Builder
	b.Grow(len(orgKinds)*(len(prefix)+len(org)+len(":{}:")) + len("acctholdshexphfingonelimu") + len(adminPlane))
	var ends [len(orgKinds)]int
	for i, kd := range orgKinds {
		writeOrgKey(&b, prefix, org, kd.kind, kd.admin)
		ends[i] = b.Len()
	}
	all := b.String()
	from := 0
	for i, end := range ends {
		*dst[i] = all[from:end]
		from = end
	}
	return k
}

// writeOrgKey writes the key of one kind: the layout itself.
func writeOrgKey(b *strings.Builder, prefix, org, kind string, admin bool) {
	b.WriteString(prefix)
	if admin {
		b.WriteString(adminPlane)
	}
	b.WriteString(":{")
	b.WriteString(org)
	b.WriteString("}:")
	b.WriteString(kind)
}

// adminPattern is the key pattern (Redis glob) of every admin-plane key under prefix: the orgs'
// limits (which carry the ledger epoch), the models' versions and the key revocations. Only the
// admin plane writes them; the data plane reads them.
func adminPattern(prefix string) string { return prefix + adminPlane + ":*" }

// dataPatterns are the key patterns of every data-plane key under prefix: the orgs' hot state
// (balances, holds, expiries, tombstones, counters), the set of orgs wanting their limits pushed
// and the models' learned max and in-flight marks. No admin key matches them.
func dataPatterns(prefix string) []string {
	return []string{prefix + ":{*", prefix + ":model:*"}
}

// ReserveKeys are the KEYS of the reserve script (lua.Reserve), in its order: acct, holds,
// hexp, gone, acct again, u. The scripts of the data plane read lim without declaring it (Redis
// checks declared keys as read-write; the data user may only read lim): lib/limits's lim_key
// names it from acct, and acct stands in lim's old place so that the keys after it keep theirs.
func (k OrgKeys) ReserveKeys() []string {
	return []string{k.Acct, k.Holds, k.Hexp, k.Gone, k.Acct, k.U}
}

// settleKeys are the settle script's KEYS: acct, holds, hexp, gone, hfin, acct again (see
// ReserveKeys), u.
func (k OrgKeys) settleKeys() []string {
	return []string{k.Acct, k.Holds, k.Hexp, k.Gone, k.Hfin, k.Acct, k.U}
}

// releaseKeys are the release and reap scripts' KEYS: acct, holds, hexp, gone, hfin, u.
func (k OrgKeys) releaseKeys() []string {
	return []string{k.Acct, k.Holds, k.Hexp, k.Gone, k.Hfin, k.U}
}

// finishKeys are the finish script's KEYS: acct, holds, hexp, hfin, u, gone.
func (k OrgKeys) finishKeys() []string {
	return []string{k.Acct, k.Holds, k.Hexp, k.Hfin, k.U, k.Gone}
}

// expiryKeys are the KEYS of the scripts that move or read expiries (extend, unpin, expired):
// hexp, hfin.
func (k OrgKeys) expiryKeys() []string { return []string{k.Hexp, k.Hfin} }

// keys returns the org's key names under the Store's prefix.
func (s *Store) keys(org string) OrgKeys { return KeysOf(s.prefix, org) }

// kindPattern is the SCAN pattern of every org's key of one kind (a field of OrgKeys, chosen by
// kind), and orgOf reads the org back from such a key.
func (s *Store) kindPattern(kind func(OrgKeys) string) (pattern string, orgOf func(key string) (string, bool)) {
	head, tail, _ := strings.Cut(kind(KeysOf(s.prefix, "\x00")), "\x00")
	return head + "*" + tail, func(key string) (string, bool) {
		rest, ok := strings.CutPrefix(key, head)
		if !ok {
			return "", false
		}
		org, ok := strings.CutSuffix(rest, tail)
		if !ok || !validOrg(org) {
			return "", false
		}
		return org, true
	}
}

// modelKey is the model's learned max cost: its own key, outside any org's slot.
func (s *Store) modelKey(model string) string { return s.prefix + ":model:" + model + ":max" }

// modelVerKey is the version of the model's last change (TouchModel): admin plane.
func (s *Store) modelVerKey(model string) string {
	return s.prefix + adminPlane + ":model:" + model + ":ver"
}

// modelUseKey holds the marks of the processes with requests of the model in flight (UseModel).
func (s *Store) modelUseKey(model string) string { return s.prefix + ":model:" + model + ":use" }

// revokedKey is RevokeKey's mark of an API key: admin plane.
func (s *Store) revokedKey(keyID string) string {
	return s.prefix + adminPlane + ":key:" + keyID + ":revoked"
}

// limWantKey is the set of orgs whose limits a data-plane store found missing (WantLimits): a
// data-plane key, so the data user may add to it; the admin plane takes them (ScanWarmOrgs)
// and pushes their limits. "!" is no org id, so it is no org's key.
func (s *Store) limWantKey() string { return s.prefix + ":{!}:limwant" }
