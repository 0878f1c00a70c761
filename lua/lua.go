// Package lua holds escrow's Redis scripts, one file per script, embedded at build time. It only
// exposes their sources; package balance loads and calls them (see its documentation for the
// keys and the invariant they keep).
//
// Every script uses only commands Redis 6.0 has, touches keys of one {org} hash tag per call
// (the model max script touches its one key), reads time with TIME, and moves money only with
// HINCRBY on argument or stored strings, never formatting a computed amount.
//
// The scripts that keep limit counters start with lib/limits.lua (hold records, counter fields,
// the UTC calendar of windows), so those rules are written once; the exported sources below
// are the scripts as Redis runs them.
package lua

import "embed"

// FS holds every script, named "<name>.lua", as written (without the shared prelude).
//
//go:embed *.lua
var FS embed.FS

//go:embed lib/limits.lua
var limitsOnly string

//go:embed lib/expiry.lua
var expiryLib string

// limitsLib is the prelude: the limits' rules, then the grants' expiries (which use them).
var limitsLib = limitsOnly + expiryLib

var (
	//go:embed reserve.lua
	reserve string
	//go:embed settle.lua
	settle string
	//go:embed release.lua
	release string
	//go:embed finish.lua
	finish string
	//go:embed reap.lua
	reap string
	//go:embed seed.lua
	seed string
)

// Lib is lib/limits.lua and lib/expiry.lua, the prelude of Reserve, Settle, Release, Finish, Reap and Seed.
var Lib = limitsLib

// The scripts' sources, as sent to Redis.
var (
	Reserve = limitsLib + reserve
	Settle  = limitsLib + settle
	Release = limitsLib + release
	Finish  = limitsLib + finish
	Reap    = limitsLib + reap
	Seed    = limitsLib + seed

	//go:embed push_limits.lua
	PushLimits string
	//go:embed expired.lua
	Expired string
	//go:embed extend.lua
	Extend string
	//go:embed unpin.lua
	Unpin string
	//go:embed state.lua
	State string
	//go:embed raise_model_max.lua
	RaiseModelMax string
	//go:embed model_use.lua
	ModelUse string
)

// Scripts maps the name of every script escrow sends to its source as sent (the names
// balance.Store calls them by, and the Redis command metric labels them with).
var Scripts = map[string]string{
	"reserve": Reserve, "settle": Settle, "release": Release, "finish": Finish, "reap": Reap, "seed": Seed,
	"expired": Expired, "extend": Extend, "unpin": Unpin, "state": State,
	"raise_model_max": RaiseModelMax, "push_limits": PushLimits, "model_use": ModelUse,
}
