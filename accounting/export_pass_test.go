package accounting

// The worker's batched statements, for the plan test.
const (
	SQLUnsettledOf  = sqlUnsettledOf
	SQLLockAccounts = sqlLockAccounts
	SQLClaim        = sqlClaim
	SQLWriteCharges = sqlWriteCharges
	SQLChargeLimits = sqlChargeLimits
)
