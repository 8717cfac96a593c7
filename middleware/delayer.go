package middleware

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Delayer holds a message for at least a delay and then delivers it again to
// the consumer it came from. It is the one thing a broker must provide for
// the republisher.
//
// Schedule must return nil only when the message is safely held (for AMQP:
// the broker confirmed the publish to a wait queue, see "Consumer
// Acknowledgements and Publisher Confirms"); the republisher acks the
// original only after that. ctx is the original message's context, which
// carries the router's subscribe topic and handler name
// (message.SubscribeTopicFromCtx), from which a Delayer finds the
// originating queue. msg is a fresh copy, safe to modify.
type Delayer interface {
	Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error
}

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

// DelayerFunc adapts a function to Delayer.
type DelayerFunc func(ctx context.Context, msg *message.Message, delay time.Duration) error

// Schedule calls f.
func (f DelayerFunc) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	return f(ctx, msg, delay)
}

// ErrCannotDelay marks a Delayer error that no later attempt can fix, e.g. a
// copy too large to be republished and delivered. The republisher then sends
// the message to the poison queue (class "undelayable") instead of nacking
// it, which would only bring the same message back.
var ErrCannotDelay = errors.New("message cannot be scheduled for retry")

// ErrDeadLetter is returned (possibly wrapped) by a Delayer that lets the
// broker hold the retry by dead-lettering the original instead of publishing
// a copy: the republisher then returns a *DeadLetterRetryError, the message
// is nacked (requeue=false), and the queue's dead-letter exchange takes it to
// a wait queue ("Dead Letter Exchanges"). No publish round trip is waited
// for, but the hop records no failure metadata, and it is only as safe as the
// queue's dead-lettering (at-least-once on quorum queues).
var ErrDeadLetter = errors.New("retry by dead-lettering the original")
