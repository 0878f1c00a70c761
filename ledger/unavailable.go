package ledger

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Unavailable reports whether err means that the ledger's database could not be reached or
// stopped answering: a failed connection, a connection lost mid-query, the server shutting down
// or refusing connections, or a deadline that ran out while waiting for it.
func Unavailable(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, ErrLedgerUnavailable) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return strings.HasPrefix(pe.Code, "08") || // connection exception
			pe.Code == "57P01" || pe.Code == "57P02" || pe.Code == "57P03" || // shutdown, cannot connect now
			pe.Code == "53300" // too many connections
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	if errors.As(err, &ce) || errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) || pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return true
	}
	msg := err.Error()
	return strings.Contains(msg, "conn closed") || strings.Contains(msg, "closed pool") || strings.Contains(msg, "broken pipe") ||
		strings.Contains(msg, "connection reset")
}
