package httpapi

// MaxLimit is maxLimit for the external tests.
const MaxLimit = maxLimit
