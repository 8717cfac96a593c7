package retrymeta

import (
	"context"
	"time"
)

type minDelayCtxKey struct{}

// WithMinimumDelay returns ctx carrying a lower bound d for the delay being
// scheduled: the republisher sets it when a handler asked for RetryAfter(d),
// so that a Delayer that rounds delays (amqpretry's tiers) rounds up, never
// bringing the message back earlier than the handler asked.
func WithMinimumDelay(ctx context.Context, d time.Duration) context.Context {
	return context.WithValue(ctx, minDelayCtxKey{}, d)
}

// MinimumDelay returns the lower bound set with WithMinimumDelay, if any.
func MinimumDelay(ctx context.Context) (time.Duration, bool) {
	d, ok := ctx.Value(minDelayCtxKey{}).(time.Duration)
	return d, ok && d > 0
}

type copyRequiredCtxKey struct{}

// WithCopyRequired returns ctx telling the Delayer that the message must be
// held as a copy: it must not answer ErrDeadLetter or ErrNativeRetry, whose
// nack of the original would count as an attempt (an x-death rejection, an
// x-acquired-count). The RedeliveryGuard sets it when it sends a delivery
// that came back before its delay was over (RemainingDelayKey) through the
// Delayer again.
func WithCopyRequired(ctx context.Context) context.Context {
	return context.WithValue(ctx, copyRequiredCtxKey{}, true)
}

// CopyRequired reports whether ctx was made by WithCopyRequired.
func CopyRequired(ctx context.Context) bool {
	ok, _ := ctx.Value(copyRequiredCtxKey{}).(bool)
	return ok
}

// DelayPlanner is implemented by a Delayer that rounds delays (amqpretry's
// tiers): PlannedDelay returns how long a retry scheduled now with ctx and
// delay would wait, so the republisher's log shows it next to the delay
// asked. It has no side effects.
type DelayPlanner interface {
	PlannedDelay(ctx context.Context, delay time.Duration) time.Duration
}
