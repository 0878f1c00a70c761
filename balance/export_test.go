package balance

// Warnings lists what New found worth a warning, for the external tests.
func Warnings(s *Store) []string { return s.warningList() }
