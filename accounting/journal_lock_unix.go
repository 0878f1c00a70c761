//go:build unix

package accounting

import (
	"errors"
	"os"
	"syscall"
)

// lockJournal takes an exclusive, non-blocking lock on the journal's file for as long as it is
// open (closing the file drops it): two processes appending to one journal, or replaying it
// into two ledgers, is refused with ErrJournalLocked instead.
func lockJournal(f *os.File) error {
	err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return ErrJournalLocked
	}
	return err
}
