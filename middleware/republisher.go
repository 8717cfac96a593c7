package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
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

// DefaultMaxAttempts is the default of RepublisherConfig.MaxAttempts (and
// router.Config.MaxAttempts): the first attempt and four retries.
const DefaultMaxAttempts = 5

// ExhaustedError is returned by the republisher when a retryable error
// happened on the last allowed attempt. The poison forwarder sends such
// messages to the poison queue with class "exhausted".
type ExhaustedError struct {
	Err      error
	Attempts int
}

// Error says how many attempts were made and why the last failed.
func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("gave up after %d attempts: %v", e.Attempts, e.Err)
}

// Unwrap returns the last handler error.
func (e *ExhaustedError) Unwrap() error { return e.Err }

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

// DeadLetterRetryError is returned when the Delayer chose dead-lettering
// (ErrDeadLetter), or the queue's native delayed retry (ErrNativeRetry,
// Native true): the nack that follows is the retry, not a failure. The
// poison forwarder passes it through.
type DeadLetterRetryError struct {
	HandlerErr error
	Attempt    int
	// Native: the retry is the queue's native delayed retry (a nack with
	// requeue), not a dead-lettering.
	Native bool
}

// Error says which attempt failed and that the broker takes the retry.
func (e *DeadLetterRetryError) Error() string {
	if e.Native {
		return fmt.Sprintf("attempt %d failed, retrying by the queue's native delayed retry: %v", e.Attempt, e.HandlerErr)
	}
	return fmt.Sprintf("attempt %d failed, retrying by dead-lettering: %v", e.Attempt, e.HandlerErr)
}

// Unwrap returns the handler error.
func (e *DeadLetterRetryError) Unwrap() error { return e.HandlerErr }

// ScheduleError is returned when the Delayer could not hold the retry copy.
// The message is then nacked, never acked: with amqpretry the broker
// dead-letters it into the wait path (see "Dead Letter Exchanges"); with
// other Pub/Subs it is redelivered according to their nack semantics.
type ScheduleError struct {
	Err        error // from Delayer.Schedule
	HandlerErr error
	Attempt    int
}

// Error describes both the scheduling failure and the handler error.
func (e *ScheduleError) Error() string {
	return fmt.Sprintf("scheduling retry after attempt %d failed: %v (handler error: %v)", e.Attempt, e.Err, e.HandlerErr)
}

// Unwrap returns the Delayer's error.
func (e *ScheduleError) Unwrap() error { return e.Err }

// ErrHandlerNotRun is (wrapped in) the HandlerErr of a ScheduleError raised
// before the handler ran: the RedeliveryGuard's copy of a redelivered
// message was not held.
var ErrHandlerNotRun = errors.New("handler not run")

// HandlerRan reports whether the handler ran and failed before the schedule
// failed (false for the RedeliveryGuard's copies).
func (e *ScheduleError) HandlerRan() bool { return !errors.Is(e.HandlerErr, ErrHandlerNotRun) }

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

// Observer is told what the retry chain did with each failed message, e.g.
// for metrics. Methods must be fast and goroutine-safe. NopObserver ignores
// everything.
type Observer interface {
	// RetryScheduled: the copy for attempt+1 is held by the Delayer; took is
	// how long Schedule needed (the publish-with-confirm latency on AMQP).
	RetryScheduled(msg *message.Message, attempt int, delay, took time.Duration)
	// RetryFailed: the Delayer returned err; the message is being nacked.
	RetryFailed(msg *message.Message, attempt int, err error)
	// Poisoned: the message was confirmed into the poison queue.
	Poisoned(msg *message.Message, attempt int, class string)
	// PoisonFailed: the poison publish failed; the message is being nacked.
	PoisonFailed(msg *message.Message, attempt int, err error)
	// Dropped: acked and discarded on ActionDrop.
	Dropped(msg *message.Message, attempt int)
}

// NopObserver implements Observer and does nothing.
type NopObserver struct{}

// RetryScheduled does nothing.
func (NopObserver) RetryScheduled(*message.Message, int, time.Duration, time.Duration) {}

// RetryFailed does nothing.
func (NopObserver) RetryFailed(*message.Message, int, error) {}

// Poisoned does nothing.
func (NopObserver) Poisoned(*message.Message, int, string) {}

// PoisonFailed does nothing.
func (NopObserver) PoisonFailed(*message.Message, int, error) {}

// Dropped does nothing.
func (NopObserver) Dropped(*message.Message, int) {}

// FormatDelay renders a delay compactly, as used in wait-queue names and
// metric labels: "250ms", "1s", "90s", "5m", "2h" (whole hours, minutes or
// seconds when exact, else milliseconds, rounded down). Negative delays render
// as "0ms".
func FormatDelay(d time.Duration) string {
	d = max(d, 0)
	switch {
	case d >= time.Hour && d%time.Hour == 0:
		return strconv.FormatInt(int64(d/time.Hour), 10) + "h"
	case d >= time.Minute && d%time.Minute == 0:
		return strconv.FormatInt(int64(d/time.Minute), 10) + "m"
	case d >= time.Second && d%time.Second == 0:
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	default:
		return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
	}
}

// DefaultMaxErrorBytes is the default cap on error text copied into headers.
const DefaultMaxErrorBytes = 1024

// ErrorText turns a handler error into the text stored in headers
// (LastErrorKey, reason_poisoned): err.Error() cut to at most maxBytes bytes
// on a UTF-8 boundary, with "…" appended when cut. Error texts can contain
// secrets (URLs with credentials, tokens): configure ErrorText in the
// Republisher and poison Forwarder configs to redact them.
func ErrorText(err error, maxBytes int) string {
	return Truncate(err.Error(), maxBytes)
}

// Truncate cuts s to at most maxBytes bytes on a UTF-8 boundary, marking a
// cut with "…". maxBytes <= 0 means no limit.
func Truncate(s string, maxBytes int) string {
	if maxBytes <= 0 || len(s) <= maxBytes {
		return s
	}
	const mark = "…"
	if maxBytes < len(mark) {
		// No room for the mark: cut without it, still within maxBytes.
		cut := maxBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		return s[:cut]
	}
	cut := maxBytes - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

// RepublisherConfig configures a Republisher.
type RepublisherConfig struct {
	// Delayer holds retry copies. Required.
	Delayer Delayer
	// MaxAttempts is the total number of attempts, the first delivery
	// included: with 5, a message is retried 4 times. Default 5; must be in
	// [1, MaxAttemptsCap].
	MaxAttempts int
	// Backoff makes a fresh backoff policy; the delay after attempt n is the
	// n-th NextBackOff of a fresh value (BackoffDelay). Default DefaultBackoff.
	// A policy returning backoff.Stop ends the retries (the message is then
	// exhausted and poisoned).
	Backoff func() backoff.BackOff
	// QueueName names the originating queue of a message, recorded once under
	// OriginalQueueKey. Default: the router's subscribe topic.
	QueueName func(ctx context.Context) string
	// ErrorText renders the handler error into LastErrorKey. Default:
	// ErrorText(err, DefaultMaxErrorBytes). Use it to redact secrets.
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
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.Backoff == nil {
		c.Backoff = DefaultBackoff
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.ErrorText == nil {
		c.ErrorText = func(err error) string { return ErrorText(err, DefaultMaxErrorBytes) }
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

// Delay returns the delay before the attempt after failed attempt n, given a
// handler-requested delay (RetryAfter, 0 if none): the larger of the two.
// ok is false when the backoff policy stops.
func (r *Republisher) Delay(n int, requested time.Duration) (time.Duration, bool) {
	d, ok := BackoffDelay(r.cfg.Backoff, n)
	if !ok {
		return 0, false
	}
	return max(d, requested), true
}

// Middleware is the delayed republisher. A message whose attempt number is
// already above MaxAttempts is not handed to the handler when its proven
// attempt number (ProvenAttempt: runs recorded by the chain, not returns
// that may not have run it) is above MaxAttempts too: it returns an
// *ExhaustedError at once (the poison forwarder poisons it). Past
// MaxAttempts only by unproven evidence (AttemptSource.Proven), it runs
// once more as attempt MaxAttempts, and a failure exhausts it. For each
// handler error:
//   - not ActionRetry (see Classifier): returned unchanged;
//   - attempt >= MaxAttempts, or the backoff stops: *ExhaustedError;
//   - else a copy (same UUID, payload and metadata; AttemptKey = attempt+1;
//     failure metadata updated) is handed to the Delayer. On success the
//     handler returns nil and the original is acked; on failure a
//     *ScheduleError is returned and the original is nacked.
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
	msg.Metadata.Set(ProvenAttemptKey, strconv.Itoa(min(ProvenAttempt(msg), m)))
	msg.SetContext(context.WithValue(ContextWithAttempt(msg.Context(), m), provenCtxKey{}, min(ProvenAttempt(msg), m)))
}

//go:noinline
func (r *Republisher) pastLastAttempt(msg *message.Message) error {
	attempt := Attempt(msg)
	last := msg.Metadata.Get(LastErrorKey)
	if last == "" {
		last = "no failure recorded"
	}
	ex := &ExhaustedError{
		Err:      fmt.Errorf("attempt %d is past MaxAttempts %d, handler not run (last error: %s)", attempt, r.cfg.MaxAttempts, last),
		Attempts: attempt,
	}
	if class := msg.Metadata.Get(ErrorClassKey); class != "" {
		// Parked by the fallback after a refused poison publish: keep the
		// class it was being poisoned with (e.g. "permanent").
		return &ClassifiedError{Err: ex, Classification: Classification{Action: ActionPoison, Class: class}}
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
		return &ExhaustedError{Err: err, Attempts: attempt}
	}
	delay, ok := r.Delay(attempt, cl.Delay)
	if !ok {
		return &ExhaustedError{Err: err, Attempts: attempt}
	}
	ctx := msg.Context()
	retry := r.copyForRetry(ctx, msg, attempt, cl, err, delay)
	schedCtx := ctx
	if cl.Delay > 0 {
		schedCtx = WithMinimumDelay(ctx, cl.Delay)
	}
	start := time.Now()
	if serr := r.cfg.Delayer.Schedule(schedCtx, retry, delay); errors.Is(serr, ErrCannotDelay) {
		// Retrying cannot work for this message: poison it rather than nack it.
		r.cfg.Observer.RetryFailed(msg, attempt, serr)
		return &ClassifiedError{
			Err:            fmt.Errorf("%w (and no retry is possible: %v)", err, serr),
			Classification: Classification{Action: ActionPoison, Class: ClassUndelayable},
		}
	} else if errors.Is(serr, ErrDeadLetter) {
		// The broker holds the retry: the nack dead-letters the original
		// (or, ErrNativeRetry, puts it into the queue's delayed state).
		native := errors.Is(serr, ErrNativeRetry)
		r.cfg.Observer.RetryScheduled(msg, attempt, delay, time.Since(start))
		logMsg := "Retry by dead-lettering"
		if native {
			logMsg = "Retry by native delayed retry"
		}
		r.cfg.Logger.Info(logMsg, watermill.LogFields{
			"message_uuid": msg.UUID, "queue": r.cfg.QueueName(ctx), "attempt": attempt,
			"next_attempt": attempt + 1, "delay": delay.String(), "error_class": cl.Class,
		})
		return &DeadLetterRetryError{HandlerErr: err, Attempt: attempt, Native: native}
	} else if serr != nil {
		// Not scheduled: never ack. The nack hands the message back to the broker.
		r.cfg.Observer.RetryFailed(msg, attempt, serr)
		r.cfg.Logger.Error("Retry not scheduled; nacking message", serr, watermill.LogFields{
			"message_uuid": msg.UUID, "attempt": attempt, "queue": r.cfg.QueueName(ctx),
		})
		return &ScheduleError{Err: serr, HandlerErr: err, Attempt: attempt}
	}
	// The copy is held (confirmed): only now may the original be acked.
	took := time.Since(start)
	r.cfg.Observer.RetryScheduled(msg, attempt, delay, took)
	r.cfg.Logger.Info("Retry scheduled", watermill.LogFields{
		"message_uuid": msg.UUID, "queue": r.cfg.QueueName(ctx), "attempt": attempt,
		"next_attempt": attempt + 1, "delay": delay.String(), "error_class": cl.Class, "error": retry.Metadata[LastErrorKey],
	})
	return nil
}

// RecordFailure writes the failure metadata shared by retry copies and
// poisoned messages into md: the first failure time (set once), the last
// failure time, the error text and class, and where the message came from:
//   - OriginalQueueKey is set to queue, the queue the message was consumed
//     from, overwriting whatever md carried: a producer cannot make a replay
//     (which goes to OriginalQueueKey) deliver the message to another queue.
//     With queue "" (unknown) the key is removed.
//   - OriginalExchangeKey and OriginalRoutingKeyKey are kept as md carries
//     them only if DeliveryRetryPathKey is "true" (the delivery came back
//     through the library's own retry path, so they were written by the
//     library on an earlier failure) and OriginalExchangeKey is present.
//     Otherwise they are set from DeliveryExchangeKey and
//     DeliveryRoutingKeyKey ("" when absent), replacing values a producer may
//     have put on the message.
func RecordFailure(md message.Metadata, now time.Time, errText, class, queue string) {
	ts := now.UTC().Format(time.RFC3339Nano)
	if md.Get(FirstFailureKey) == "" {
		md.Set(FirstFailureKey, ts)
	}
	md.Set(LastFailureKey, ts)
	md.Set(LastErrorKey, errText)
	md.Set(ErrorClassKey, class)
	if _, ok := md[OriginalExchangeKey]; !ok || md.Get(DeliveryRetryPathKey) != "true" {
		md.Set(OriginalExchangeKey, md.Get(DeliveryExchangeKey))
		md.Set(OriginalRoutingKeyKey, md.Get(DeliveryRoutingKeyKey))
	}
	if queue != "" {
		md.Set(OriginalQueueKey, queue)
	} else {
		delete(md, OriginalQueueKey)
	}
}

// CloneMessage returns a new message with msg's UUID, payload and a copy of
// its metadata (delivery-only keys included: strip them with
// StripDeliveryMetadata once the failure is recorded), except
// RemainingDelayKey: the Delayer that schedules the copy writes it anew if
// it cannot hold the copy's whole delay. The copy has a background context
// and no ack state of its own.
func CloneMessage(msg *message.Message) *message.Message {
	c := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if k != RemainingDelayKey {
			c.Metadata[k] = v
		}
	}
	return c
}

func (r *Republisher) copyForRetry(ctx context.Context, msg *message.Message, attempt int, cl Classification, err error, delay time.Duration) *message.Message {
	c := CloneMessage(msg)
	RecordFailure(c.Metadata, r.cfg.Now(), r.cfg.ErrorText(err), cl.Class, r.cfg.QueueName(ctx))
	StripDeliveryMetadata(c.Metadata)
	c.Metadata.Set(AttemptKey, strconv.Itoa(attempt+1))
	c.Metadata.Set(ProvenAttemptKey, strconv.Itoa(min(ProvenAttempt(msg), attempt)+1))
	c.Metadata.Set(DelayKey, strconv.FormatInt(delay.Milliseconds(), 10))
	return c
}
