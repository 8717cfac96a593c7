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
