package middleware

// Exempt orgs (issue 36; DESIGN.md "Two planes"): the platform's own users. Their requests are
// authenticated, checked against freezes, the in-flight cap and every limit by the same reserve
// call as anyone's, but the hold is a zero hold (balance.ReserveRequest.Exempt): no money is
// held, the balance is never checked, and the real cost moves into the hold at finish and into
// the ledger at settle, like any request's. A negative balance is allowed and shown.
// The hold amount computed for the request is kept as the call's agreed amount, so an estimate
// (a response without readable usage) is bounded as it would be with a hold, like fail-open.

// exemptHold marks an exempt call's granted hold as the zero hold it is.
func exemptHold(cl *call, o *Outcome, err error) {
	if err == nil && cl.id.Exempt {
		cl.holdAmount, o.HoldAmount = 0, 0
	}
}
