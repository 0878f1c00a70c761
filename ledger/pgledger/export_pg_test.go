package pgledger

// The worker's batched statements, for the plan test.
const (
	SQLLockAccounts = sqlLockAccounts
	SQLClaimPass    = sqlClaimPass
	SQLClaimOrg     = sqlClaimOrg
	SQLPendingRows  = sqlPendingRows
	SQLWriteCharges = sqlWriteCharges
	SQLEndUserUsed  = sqlEndUserUsed
	SQLChargeLimits = sqlChargeLimits
	SQLMarkSettled  = sqlMarkSettledMany
	SQLKeyedPlans   = sqlKeyedPlans
)

// SQLLowBalance is the balance.low outbox statement, for the plan test.
var SQLLowBalance = sqlOutboxLowBalance
