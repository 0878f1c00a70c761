// Package pgledger is the ledger in PostgreSQL (Open, New): accounts, entries with per-org
// sequence numbers, usage events and their accounting under the org's advisory lock, keys,
// models, limits and their windows, the console's reads, the webhook outbox written in the
// transaction of the change that triggers it, and NOTIFY for the worker. Its tables are package
// migrations'. It implements every role of ledger.Ledger (ledger/ledgertest is its spec).
package pgledger
