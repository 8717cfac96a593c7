package retrymeta

import (
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Defaults of the retry policy (router.Policy, filled in by
// FillPolicyDefaults, and the middlewares' own Configs), documented on the
// fields that use them.

// DefaultMaxAttempts is the default of middleware.RepublisherConfig.MaxAttempts (and
// router.Policy.MaxAttempts): the first attempt and four retries.
const DefaultMaxAttempts = 5

// DefaultMaxRedeliveries is the default of middleware.RedeliveryGuardConfig.MaxRedeliveries.
const DefaultMaxRedeliveries = 3

// DefaultFallbackPause is the default of router.Policy.FallbackPause.
const DefaultFallbackPause = time.Second

// FillPolicyDefaults sets the zero MaxAttempts, Backoff, MaxRedeliveries
// and FallbackPause of a router.Policy, passed field by field (this package
// is below router), to their defaults; the other fields keep nil, which
// their users read as the default. router.New and amqpretry.New call it, so
// one Policy gets the same defaults in both.
func FillPolicyDefaults(maxAttempts *int, bo *func() backoff.BackOff, maxRedeliveries *int, fallbackPause *time.Duration) {
	if *maxAttempts == 0 {
		*maxAttempts = DefaultMaxAttempts
	}
	if *bo == nil {
		*bo = DefaultBackoff
	}
	if *maxRedeliveries == 0 {
		*maxRedeliveries = DefaultMaxRedeliveries
	}
	if *fallbackPause == 0 {
		*fallbackPause = DefaultFallbackPause
	}
}
