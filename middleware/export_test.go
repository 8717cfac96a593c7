package middleware

import (
	"time"
)

// Unexported helpers the external tests (package middleware_test) use.
var (
	ContextWithAttempt = contextWithAttempt
	AttemptFromContext = attemptFromContext
)

// Delay is delayFor, for the tests.
func (r *Republisher) Delay(n int, requested time.Duration) (time.Duration, bool) {
	return r.delayFor(n, requested)
}

// ClassifiedError is the chain's wrapping of a classified handler error,
// for the external tests that inject a classification.
type ClassifiedError = classifiedError

// Unexported predicates and methods the external tests use.
var (
	IsPermanent         = isPermanent
	IsDrop              = isDrop
	DefaultShouldPoison = defaultShouldPoison
)
