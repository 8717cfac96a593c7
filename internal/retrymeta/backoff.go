package retrymeta

import (
	"time"

	"github.com/cenkalti/backoff/v4"
)

// BackoffDelay returns the delay after failed attempt n (1-based) under
// policy: a fresh policy() advanced n times, so it depends on n only, never
// on shared state. ok is false when the policy says stop (backoff.Stop).
func BackoffDelay(policy func() backoff.BackOff, n int) (d time.Duration, ok bool) {
	b := policy()
	b.Reset()
	for i := 0; i < max(n, 1); i++ {
		d = b.NextBackOff()
		if d == backoff.Stop {
			return 0, false
		}
	}
	return max(d, 0), true
}

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
