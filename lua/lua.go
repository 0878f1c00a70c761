// Package lua holds escrow's Redis scripts, one file per script, embedded at build time. It only
// exposes their sources; package balance loads and calls them (see its documentation for the
// keys and the invariant they keep).
//
// Every script uses only commands Redis 6.0 has, touches keys of one {org} hash tag per call
// (the model max script touches its one key), reads time with TIME, and moves money only with
// HINCRBY on argument or stored strings, never formatting a computed amount.
package lua

import "embed"

// FS holds every script, named "<name>.lua".
//
//go:embed *.lua
var FS embed.FS

// The scripts' sources.
var (
	//go:embed reserve.lua
	Reserve string
	//go:embed settle.lua
	Settle string
	//go:embed release.lua
	Release string
	//go:embed finish.lua
	Finish string
	//go:embed reap.lua
	Reap string
	//go:embed expired.lua
	Expired string
	//go:embed extend.lua
	Extend string
	//go:embed unpin.lua
	Unpin string
	//go:embed seed.lua
	Seed string
	//go:embed state.lua
	State string
	//go:embed raise_model_max.lua
	RaiseModelMax string
)
