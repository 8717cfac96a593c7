package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// RepublisherConfig configures a Republisher.
type RepublisherConfig struct {
	// Delayer holds retry copies. Required.
	Delayer Delayer
	// MaxAttempts is the total number of attempts, the first delivery
	// included: with 5, a message is retried 4 times. Default 5; must be in
	// [1, MaxAttemptsCap].
	MaxAttempts int
	// Backoff makes a fresh backoff policy; the delay after attempt n is the
	// n-th NextBackOff of a fresh value. Default: exponential from 1 s, factor 2, ±50% jitter, 5 min cap.
	// A policy returning backoff.Stop ends the retries (the message is then
	// exhausted and poisoned).
	Backoff func() backoff.BackOff
	// QueueName names the originating queue of a message, recorded once under
	// OriginalQueueKey. Default: the router's subscribe topic.
	QueueName func(ctx context.Context) string
	// ErrorText renders the handler error into LastErrorKey. Default:
	// the error text cut to 1 KiB on a UTF-8 boundary. Use it to redact secrets.
	ErrorText func(error) string
	// Now returns the current time. Default time.Now.
	Now func() time.Time
	// Observer is told of each scheduled or failed retry. Default NopObserver.
	Observer Observer
	// Logger logs each retry at Info with message UUID, queue, attempt and
	// delay. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *RepublisherConfig) setDefaults() {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = retrymeta.DefaultMaxAttempts
	}
	if c.Backoff == nil {
		c.Backoff = retrymeta.DefaultBackoff
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.ErrorText == nil {
		c.ErrorText = func(err error) string { return retrymeta.ErrorText(err, retrymeta.DefaultMaxErrorBytes) }
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Observer == nil {
		c.Observer = NopObserver{}
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field.
func (c RepublisherConfig) Validate() error {
	if c.Delayer == nil {
		return errors.New("RepublisherConfig.Delayer is nil")
	}
	if c.MaxAttempts < 1 || c.MaxAttempts > MaxAttemptsCap {
		return fmt.Errorf("RepublisherConfig.MaxAttempts %d is outside [1, %d]", c.MaxAttempts, MaxAttemptsCap)
	}
	return nil
}

// Republisher is the delayed republisher: on a retryable error with attempts
// left it schedules a copy of the message for the next attempt through the
// Delayer, and acks the original only once the Delayer confirmed.
type Republisher struct {
	cfg RepublisherConfig
}

// NewRepublisher returns a Republisher, or the error of cfg.Validate after
// defaults are filled in.
func NewRepublisher(cfg RepublisherConfig) (*Republisher, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Republisher{cfg: cfg}, nil
}

// MaxAttempts returns the configured total number of attempts.
func (r *Republisher) MaxAttempts() int { return r.cfg.MaxAttempts }

// delayFor returns the delay before the attempt after failed attempt n, given a
// handler-requested delay (RetryAfter, 0 if none): the larger of the two.
// ok is false when the backoff policy stops.
func (r *Republisher) delayFor(n int, requested time.Duration) (time.Duration, bool) {
	d, ok := retrymeta.BackoffDelay(r.cfg.Backoff, n)
	if !ok {
		return 0, false
	}
	return max(d, requested), true
}

// Middleware is the delayed republisher. A message whose attempt number is
// already above MaxAttempts is not handed to the handler when its proven
// attempt number (ProvenAttempt: runs recorded by the chain, not returns
// that may not have run it) is above MaxAttempts too: it returns an
// exhausted error at once (the poison forwarder poisons it). Past
// MaxAttempts only by unproven evidence (AttemptSource.Proven), it runs
// once more as attempt MaxAttempts, and a failure exhausts it. For each
// handler error:
//   - not ActionRetry (see Classifier): returned unchanged;
//   - attempt >= MaxAttempts, or the backoff stops: an exhausted error (poisoned);
//   - else a copy (same UUID, payload and metadata; AttemptKey = attempt+1;
//     failure metadata updated) is handed to the Delayer. On success the
//     handler returns nil and the original is acked; on failure a
//     schedule error is returned and the original is nacked (the router's
//     fallback then sends it back to its queue).
//
// Messages the handler produced on a failed attempt are discarded.
func (r *Republisher) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if Attempt(msg) > r.cfg.MaxAttempts {
			if ProvenAttempt(msg) > r.cfg.MaxAttempts {
				// Already past the last attempt by runs (a poison publish
				// that failed and was parked by the Fallback): straight to
				// the poison queue, without running the handler again.
				return nil, r.pastLastAttempt(msg)
			}
			// Past it only by returns that may not have run the handler
			// (NackCountSource): run once more, as the last attempt.
			r.lastAttempt(msg)
		}
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		return nil, r.onFailure(msg, err)
	}
}

// lastAttempt makes msg's attempt number MaxAttempts (context and
// AttemptKey), so that a failure exhausts it.
//
//go:noinline
func (r *Republisher) lastAttempt(msg *message.Message) {
	m := r.cfg.MaxAttempts
	r.cfg.Logger.Info("Attempt number past MaxAttempts only by returns that may not have run the handler; running it as the last attempt", watermill.LogFields{
		"message_uuid": msg.UUID, "queue": r.cfg.QueueName(msg.Context()), "counted_attempt": Attempt(msg),
		"proven_attempt": ProvenAttempt(msg), "attempt": m,
	})
	msg.Metadata.Set(AttemptKey, strconv.Itoa(m))
	msg.Metadata.Set(retrymeta.ProvenAttemptKey, strconv.Itoa(min(ProvenAttempt(msg), m)))
	msg.SetContext(context.WithValue(contextWithAttempt(msg.Context(), m), provenCtxKey{}, min(ProvenAttempt(msg), m)))
}

//go:noinline
func (r *Republisher) pastLastAttempt(msg *message.Message) error {
	attempt := Attempt(msg)
	last := msg.Metadata.Get(LastErrorKey)
	if last == "" {
		last = "no failure recorded"
	}
	ex := &chainerr.ExhaustedError{
		Err:      fmt.Errorf("attempt %d is past MaxAttempts %d, handler not run (last error: %s)", attempt, r.cfg.MaxAttempts, last),
		Attempts: attempt,
	}
	if class := msg.Metadata.Get(ErrorClassKey); class != "" {
		// Parked by the fallback after a refused poison publish: keep the
		// class it was being poisoned with (e.g. "permanent").
		return &classifiedError{Err: ex, Classification: Classification{Action: ActionPoison, Class: class}}
	}
	return ex
}

// onFailure handles a handler error. It is kept out of line so that the
// success path's closure stays small: Watermill runs each message on a fresh
// goroutine, and large frames in the chain force a stack copy per message.
//
//go:noinline
func (r *Republisher) onFailure(msg *message.Message, err error) error {
	cl := classificationOf(err)
	if cl.Action != ActionRetry {
		return err
	}
	attempt := Attempt(msg)
	if attempt >= r.cfg.MaxAttempts {
		return &chainerr.ExhaustedError{Err: err, Attempts: attempt}
	}
	delay, ok := r.delayFor(attempt, cl.Delay)
	if !ok {
		return &chainerr.ExhaustedError{Err: err, Attempts: attempt}
	}
	ctx := msg.Context()
	retry := r.copyForRetry(ctx, msg, attempt, cl, err, delay)
	schedCtx := ctx
	if cl.Delay > 0 {
		schedCtx = retrymeta.WithMinimumDelay(ctx, cl.Delay)
	}
	start := time.Now()
	if serr := r.cfg.Delayer.Schedule(schedCtx, retry, delay); errors.Is(serr, ErrCannotDelay) {
		// Retrying cannot work for this message: poison it rather than nack it.
		r.cfg.Observer.RetryFailed(msg, attempt, serr)
		return &classifiedError{
			Err:            fmt.Errorf("%w (and no retry is possible: %v)", err, serr),
			Classification: Classification{Action: ActionPoison, Class: ClassUndelayable},
		}
	} else if errors.Is(serr, chainerr.ErrDeadLetter) {
		// The broker holds the retry: the nack dead-letters the original
		// (or, chainerr.ErrNativeRetry, puts it into the queue's delayed state).
		native := errors.Is(serr, chainerr.ErrNativeRetry)
		r.cfg.Observer.RetryScheduled(msg, attempt, delay, time.Since(start))
		logMsg := "Retry by dead-lettering"
		if native {
			logMsg = "Retry by native delayed retry"
		}
		r.cfg.Logger.Info(logMsg, watermill.LogFields{
			"message_uuid": msg.UUID, "queue": r.cfg.QueueName(ctx), "attempt": attempt,
			"next_attempt": attempt + 1, "delay": delay.String(), "error_class": cl.Class,
		})
		return &chainerr.DeadLetterRetryError{HandlerErr: err, Attempt: attempt, Native: native}
	} else if serr != nil {
		// Not scheduled: never ack. The nack hands the message back to the broker.
		r.cfg.Observer.RetryFailed(msg, attempt, serr)
		r.cfg.Logger.Error("Retry not scheduled; nacking message", serr, watermill.LogFields{
			"message_uuid": msg.UUID, "attempt": attempt, "queue": r.cfg.QueueName(ctx),
		})
		return &chainerr.ScheduleError{Err: serr, HandlerErr: err, Attempt: attempt}
	}
	// The copy is held (confirmed): only now may the original be acked.
	took := time.Since(start)
	r.cfg.Observer.RetryScheduled(msg, attempt, delay, took)
	r.cfg.Logger.Info("Retry scheduled", watermill.LogFields{
		"message_uuid": msg.UUID, "queue": r.cfg.QueueName(ctx), "attempt": attempt,
		"next_attempt": attempt + 1, "delay": delay.String(), "scheduled_delay": r.planned(schedCtx, delay).String(),
		"error_class": cl.Class, "error": retry.Metadata[LastErrorKey],
	})
	return nil
}

// planned is the delay the Delayer waits for a retry asked with delay: the
// same unless it rounds delays (retrymeta.DelayPlanner, amqpretry's tiers).
func (r *Republisher) planned(ctx context.Context, delay time.Duration) time.Duration {
	if p, ok := r.cfg.Delayer.(retrymeta.DelayPlanner); ok {
		return p.PlannedDelay(ctx, delay)
	}
	return delay
}

func (r *Republisher) copyForRetry(ctx context.Context, msg *message.Message, attempt int, cl Classification, err error, delay time.Duration) *message.Message {
	c := retrymeta.CloneMessage(msg)
	retrymeta.RecordFailure(c.Metadata, r.cfg.Now(), r.cfg.ErrorText(err), cl.Class, r.cfg.QueueName(ctx))
	retrymeta.StripDeliveryMetadata(c.Metadata)
	c.Metadata.Set(AttemptKey, strconv.Itoa(attempt+1))
	c.Metadata.Set(retrymeta.ProvenAttemptKey, strconv.Itoa(min(ProvenAttempt(msg), attempt)+1))
	c.Metadata.Set(DelayKey, strconv.FormatInt(delay.Milliseconds(), 10))
	return c
}
