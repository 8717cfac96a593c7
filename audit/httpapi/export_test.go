package httpapi

// MaxLimit is maxLimit for the external tests.
const MaxLimit = maxLimit

// EmptyFilter is emptyFilter for the external tests.
var EmptyFilter = emptyFilter
