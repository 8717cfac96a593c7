package metrics

// The metric tables, for the external tests that compare them with what
// is registered and with docs/monitoring.md.
var (
	Descriptions        = descriptions
	WaitingDescriptions = waitingDescriptions
)
