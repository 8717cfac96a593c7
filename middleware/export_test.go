package middleware

// Unexported helpers the external tests (package middleware_test) use.
var (
	ContextWithAttempt = contextWithAttempt
	AttemptFromContext = attemptFromContext
)
