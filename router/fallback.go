package router

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// defaultFallbackPause is the default of Config.FallbackPause.
const defaultFallbackPause = retrymeta.DefaultFallbackPause

// fallbackMaxHold bounds how long the fallback holds a delivery for a
// handler's RetryAfter (the subscription handles one message at a time, and
// the broker's consumer timeout, 30 min by default, must not fire).
const fallbackMaxHold = time.Minute

// fallback is the outermost settlement step, just inside the attempt
// counter. It sees only failures that nothing further in could settle: a
// retry copy the Delayer did not hold (*chainerr.ScheduleError), a poison
// copy the broker did not take (*chainerr.PoisonError), or anything else that
// would end in a nack. For those it never relies on the broker's
// dead-lettering of the original (at-most-once on classic queues) and never
// requeues at once (a hot loop):
//
//  1. it pauses (FallbackPause, cut short by shutdown), so a broker that
//     refuses publishes (alarm, full queue, missing exchange) is not hammered;
//     for a failed retry whose handler asked for a delay (RetryAfter) it
//     pauses at least that long, since the copy it then sends has no
//     broker-side delay: the next attempt never runs earlier than asked.
//     A RetryAfter above one minute is not held here: after the pause the
//     copy is handed to the Delayer once more with the remaining delay; if
//     that fails too, the copy goes back to the queue carrying the
//     remaining delay (rabbitretry-remaining-delay-ms), so the
//     RedeliveryGuard does not run it but hands it to the Delayer again
//     (logged at Error);
//  2. it hands a copy to the Delayer with delay 0 (amqpretry: straight back to
//     the origin queue through the loop-back exchange, confirmed), counted as
//     the next attempt for a failed retry, or as past the last attempt for a
//     failed poison publish, so the handler never runs again for it (the
//     Republisher sends such a copy straight to the poison queue); the
//     original is acked once the copy is held;
//  3. if that copy is refused too, the error is returned and the subscriber
//     nacks with requeue: the message stays in its queue, and its redelivery
//     is counted by the RedeliveryGuard.
//
// Failures classified middleware.ActionNack (the delivery was already given
// back by the subscriber) and *chainerr.DeadLetterRetryError (the nack is
// the retry) pass through untouched.
type fallback struct {
	delayer     middleware.Delayer
	maxAttempts int
	pause       time.Duration
	errorText   func(error) string
	queueName   func(ctx context.Context) string
	logger      watermill.LoggerAdapter
}

func (f *fallback) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		return nil, f.onFailure(msg, err)
	}
}

//go:noinline
func (f *fallback) onFailure(msg *message.Message, err error) error {
	var dl *chainerr.DeadLetterRetryError
	if errors.As(err, &dl) {
		return err
	}
	if action, _, ok := chainerr.Classified(err); ok && middleware.Action(action) == middleware.ActionNack {
		return err
	}
	ctx := msg.Context()
	start := time.Now()
	attempt := middleware.Attempt(msg)
	var next, proven int
	var handlerErr error
	var asked time.Duration // the handler's RetryAfter, if any
	var se *chainerr.ScheduleError
	var pe *chainerr.PoisonError
	switch {
	case errors.As(err, &se) && se.HandlerRan():
		next, handlerErr = se.Attempt+1, se.HandlerErr
		proven = min(middleware.ProvenAttempt(msg), se.Attempt) + 1 // this run failed
		asked, _ = chainerr.RetryAfter(se.HandlerErr)
	case errors.As(err, &pe):
		next, handlerErr = max(attempt, f.maxAttempts+1), pe.HandlerErr
		proven = next // to be poisoned: never run again
	default:
		// Nothing a copy would fix (e.g. the RedeliveryGuard's own copy of a
		// redelivered message was refused): pause, then requeue.
		f.wait(ctx, f.pause)
		return err
	}
	if !f.wait(ctx, f.pause) {
		return err // shutting down: the subscriber returns the delivery
	}
	c := retrymeta.CloneMessage(msg)
	retrymeta.RecordFailure(c.Metadata, time.Now(), f.errorText(handlerErr), chainerr.ErrorClass(handlerErr), f.queueName(ctx))
	retrymeta.StripDeliveryMetadata(c.Metadata)
	c.Metadata.Set(middleware.AttemptKey, strconv.Itoa(next))
	c.Metadata.Set(retrymeta.ProvenAttemptKey, strconv.Itoa(proven))
	if remaining := asked - time.Since(start); remaining > 0 {
		// The handler asked for a delay (RetryAfter) and the copy below goes
		// straight back to the queue: never let it run earlier than asked.
		if remaining > fallbackMaxHold {
			// Too long to hold the delivery here: try the delayed path again.
			serr := f.delayer.Schedule(retrymeta.WithMinimumDelay(ctx, remaining), c, remaining)
			if serr == nil {
				f.logger.Info("Fallback: retry copy held on the second try", watermill.LogFields{
					"message_uuid": msg.UUID, "queue": f.queueName(ctx), "attempt": attempt, "next_attempt": next, "delay": remaining.String(),
				})
				return nil
			}
			f.logger.Error("Fallback: retry copy not held on the second try; the copy goes back to the queue carrying the remaining delay, to be held again before it runs", serr, watermill.LogFields{
				"message_uuid": msg.UUID, "queue": f.queueName(ctx), "attempt": attempt, "asked": asked.String(), "remaining": remaining.String(),
			})
			retrymeta.SetRemainingDelay(c.Metadata, remaining)
			remaining = 0
		}
		if !f.wait(ctx, remaining) {
			return err
		}
	}
	if serr := f.delayer.Schedule(ctx, c, 0); serr != nil {
		f.logger.Error("Fallback copy not held either; returning the message to the broker (requeue)", serr, watermill.LogFields{
			"message_uuid": msg.UUID, "queue": f.queueName(ctx), "attempt": attempt, "next_attempt": next,
		})
		return errors.Join(err, serr)
	}
	f.logger.Info("Fallback copy held: message back in its queue", watermill.LogFields{
		"message_uuid": msg.UUID, "queue": f.queueName(ctx), "attempt": attempt, "next_attempt": next, "error": err.Error(),
	})
	return nil
}

// wait pauses for d; false if ctx ended first.
func (f *fallback) wait(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
