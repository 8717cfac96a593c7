package retrymeta

// TracingScope is the instrumentation scope name of the Tracing spans.
const TracingScope = "github.com/rabbitretry/rabbitretry"

// Span attribute keys the Tracing middleware (package middleware) adds to the messaging semantic
// conventions (which have no retry attribute).
const (
	AttrAttempt     = "rabbitretry.retry.attempt"      // int, 1-based
	AttrMaxAttempts = "rabbitretry.retry.max_attempts" // int
	AttrOutcome     = "rabbitretry.retry.outcome"      // ack | retry_scheduled | poisoned | dropped | nack
	AttrErrorClass  = "rabbitretry.retry.error_class"  // ErrorClassKey's value
	AttrDelayMs     = "rabbitretry.retry.delay_ms"     // int, the delay chosen for the retry
)
