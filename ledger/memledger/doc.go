// Package memledger is the in-memory ledger (New): the embedded default for one process with an
// embedded Redis, and the fast store of tests. It implements every role of ledger.Ledger,
// webhooks included, exactly as ledger/pgledger does (ledger/ledgertest runs on both), and
// forgets everything when the process ends.
package memledger
