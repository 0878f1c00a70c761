// Package accounting is the rules that run over a ledger (package ledger) and the hot balance
// (package balance): the Recorder that makes usage durable before a response ends (group
// commits, the local Journal while the ledger is down, pinning, Finish), the Worker that
// accounts usage into entries, settles them into Redis, reaps and reconciles, and Ops, the
// operator's operations that have a hot-balance step or a rule (credits and adjustments settled
// before they return, key revocations and model changes pushed to Redis, limits, price imports,
// the customer's view). What is one ledger call is asked of the ledger's roles directly
// (Ops.Ledger). It never imports a store: it is given a ledger.Ledger.
package accounting
