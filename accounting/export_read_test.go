package accounting

// SQLListEntries is ListEntries' query, for the plan test.
const SQLListEntries = sqlListEntries
