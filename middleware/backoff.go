package middleware

import (
	"time"

	"github.com/cenkalti/backoff/v4"
)

// DefaultBackoff returns the default policy: exponential from 1 s, factor 2,
// capped at 5 min per attempt, with ±50% jitter (RandomizationFactor 0.5) and
// no elapsed-time limit. A fresh value is made per computation: backoff/v4's
// ExponentialBackOff is stateful and not goroutine-safe.
func DefaultBackoff() backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = time.Second
	b.Multiplier = 2
	b.RandomizationFactor = 0.5
	b.MaxInterval = 5 * time.Minute
	b.MaxElapsedTime = 0
	b.Reset()
	return b
}
