package balance

// Warnings lists what New found worth a warning, for the external tests.
func Warnings(s *Store) []string { return s.warningList() }

// ScriptCount is how many scripts a Store loads on each server.
func ScriptCount() int { return len(newScripts()) }

// ErrNotReplicated is the error a reserve the replicas did not acknowledge wraps (with ErrRedis).
var ErrNotReplicated = errNotReplicated
