// Package ledger is what a ledger is, independent of where it is kept: the domain types (usage
// events, entries, accounts, models, API keys, limits, webhook endpoints and deliveries, the
// console's read models), the role interfaces a store implements (Ledger and its roles:
// EpochStore, Accounts, UsageStore, QuietUsageStore, Settlement, Listener, ModelStore, KeyStore,
// LimitStore, Console, Webhooks), the sentinel errors, and the logic both stores share that needs
// no SQL: validation of events, models, names, limits and webhooks, cursor paging, limit windows
// and their attribution, the limit-crossed thresholds, AccountResult's folding of a pass.
//
// The stores are ledger/memledger (in memory) and ledger/pgledger (PostgreSQL); the conformance
// suite both answer to is ledger/ledgertest. The rules that run over a ledger (the recorder, the
// worker, the operator's operations) are package accounting; prices and costs are package
// pricing.
package ledger
