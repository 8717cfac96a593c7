package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// DefaultMaxRedeliveries is the default of RedeliveryGuardConfig.MaxRedeliveries.
const DefaultMaxRedeliveries = 3

// RedeliveryGuardConfig configures a RedeliveryGuard.
type RedeliveryGuardConfig struct {
	// Delayer takes the counted copy of a redelivered message with delay 0
	// (amqpretry publishes it to the origin queue through the loop-back
	// exchange, confirmed). Required.
	Delayer Delayer
	// MaxRedeliveries is how many times a message may come back redelivered
	// before it is poisoned (class ClassRedeliveryLimit) without running the
	// handler again. Default DefaultMaxRedeliveries (3); range [1, MaxAttemptsCap].
	MaxRedeliveries int
	// QueueName names the originating queue (for logs). Default: the router's
	// subscribe topic.
	QueueName func(ctx context.Context) string
	// Logger logs each redelivery at Info. Default NopLogger.
	Logger watermill.LoggerAdapter
	// RedeliveriesCounted: the attempt sources already count every
	// redelivery as an attempt (AcquiredCountSource, amqpretry's native
	// delayed retry, where each retry is a redelivery). The guard then lets
	// redelivered messages run like any other, without a copy (a copy would
	// undo the broker's delay) and without MaxRedeliveries: MaxAttempts
	// bounds crash loops instead. Default false.
	RedeliveriesCounted bool
}

func (c *RedeliveryGuardConfig) setDefaults() {
	if c.MaxRedeliveries == 0 {
		c.MaxRedeliveries = DefaultMaxRedeliveries
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field.
func (c RedeliveryGuardConfig) Validate() error {
	if c.Delayer == nil {
		return errors.New("RedeliveryGuardConfig.Delayer is nil")
	}
	if c.MaxRedeliveries < 1 || c.MaxRedeliveries > MaxAttemptsCap {
		return fmt.Errorf("RedeliveryGuardConfig.MaxRedeliveries %d is outside [1, %d]", c.MaxRedeliveries, MaxAttemptsCap)
	}
	return nil
}

// RedeliveryGuard counts broker redeliveries, so that a message that kills
// or stalls its consumer (a crash, an OOM kill, a handler running past the
// broker's consumer_timeout) ends in the poison queue instead of coming back
// as the same attempt forever.
//
// RabbitMQ sets the redelivered flag on a delivery whose earlier delivery
// was returned without an ack ("Consumer Acknowledgements and Publisher
// Confirms", "Negative Acknowledgement and Requeuing"), but classic queues
// keep no count, and quorum queues count differently across versions (4.3:
// only basic.reject and crashes raise x-delivery-count). The guard therefore
// keeps its own count on the message: a delivery with
// DeliveryRedeliveredKey set is not handed to the handler; instead a copy
// with RedeliveriesKey incremented (attempt number, payload and metadata
// unchanged) is handed to the Delayer with delay 0, and the redelivered
// original is acked once the copy is held (confirmed). The copy then runs as
// usual. A redelivery does not consume an attempt: the flag cannot tell a
// handler that crashed from a delivery that sat unprocessed in a consumer's
// prefetch buffer when its channel closed.
//
// Early deliveries: a delivery that came back through the library's retry
// path before its whole delay was over (a RetryAfter or backoff delay longer
// than the Delayer's longest hold, see RemainingDelayKey) is not run either,
// and is not counted as a redelivery or an attempt (the handler never saw
// it): a copy with the same attempt number and redelivery count is handed to
// the Delayer for the remaining delay (with WithMinimumDelay, so a tiered
// Delayer rounds up, and WithCopyRequired), and the original is acked once
// the copy is held. This check comes first, also for a redelivered delivery
// and with RedeliveriesCounted. The errors are the same as for a
// redelivery's copy.
//
// Past MaxRedeliveries the guard returns a *ClassifiedError with
// ActionPoison and class ClassRedeliveryLimit (the forwarder poisons it).
// ErrCannotDelay from the Delayer poisons it as ClassUndelayable. If the
// copy cannot be held for any other reason (publisher closed, broker alarm),
// it returns a *ScheduleError whose HandlerErr wraps ErrHandlerNotRun: the
// message goes back to the broker unprocessed and waits there until a copy
// can be held.
type RedeliveryGuard struct {
	cfg RedeliveryGuardConfig
}

// NewRedeliveryGuard returns a RedeliveryGuard, or cfg.Validate's error
// after defaults are filled in.
func NewRedeliveryGuard(cfg RedeliveryGuardConfig) (*RedeliveryGuard, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &RedeliveryGuard{cfg: cfg}, nil
}

// Redeliveries returns the redelivery count a message carries
// (RedeliveriesKey): 0 when absent or malformed, at most MaxAttemptsCap.
func Redeliveries(msg *message.Message) int {
	v := msg.Metadata.Get(RedeliveriesKey)
	if v == "" {
		return 0
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return clampAttempt(n)
}

// Middleware runs h for deliveries that are not redelivered; see
// RedeliveryGuard for the others.
func (g *RedeliveryGuard) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if d := RemainingDelay(msg); d > 0 {
			return nil, g.onEarly(msg, d)
		}
		if !g.cfg.RedeliveriesCounted && msg.Metadata.Get(DeliveryRedeliveredKey) != "" {
			return nil, g.onRedelivered(msg)
		}
		return h(msg)
	}
}

//go:noinline
func (g *RedeliveryGuard) onRedelivered(msg *message.Message) error {
	ctx := msg.Context()
	attempt := Attempt(msg)
	n := Redeliveries(msg) + 1
	fields := watermill.LogFields{
		"message_uuid": msg.UUID, "queue": g.cfg.QueueName(ctx), "attempt": attempt, "redeliveries": n,
	}
	if n > g.cfg.MaxRedeliveries {
		return &ClassifiedError{
			Err: fmt.Errorf("redelivered %d times (more than MaxRedeliveries %d): it crashed, timed out or was returned by its consumer each time",
				n, g.cfg.MaxRedeliveries),
			Classification: Classification{Action: ActionPoison, Class: ClassRedeliveryLimit},
		}
	}
	c := CloneMessage(msg)
	StripDeliveryMetadata(c.Metadata)
	c.Metadata.Set(AttemptKey, strconv.Itoa(attempt))
	c.Metadata.Set(RedeliveriesKey, strconv.Itoa(n))
	serr := g.cfg.Delayer.Schedule(ctx, c, 0)
	if serr == nil {
		g.cfg.Logger.Info("Redelivered message counted and requeued as a copy", fields)
		return nil
	}
	return g.copyNotHeld(serr, attempt, fields, "redelivered")
}

// onEarly sends a delivery that came back before its delay was over through
// the Delayer again for the remaining delay d.
//
//go:noinline
func (g *RedeliveryGuard) onEarly(msg *message.Message, d time.Duration) error {
	ctx := msg.Context()
	attempt := Attempt(msg)
	fields := watermill.LogFields{
		"message_uuid": msg.UUID, "queue": g.cfg.QueueName(ctx), "attempt": attempt, "remaining": d.String(),
	}
	c := CloneMessage(msg) // without RemainingDelayKey: the Delayer writes what it cannot hold
	StripDeliveryMetadata(c.Metadata)
	c.Metadata.Set(AttemptKey, strconv.Itoa(attempt))
	serr := g.cfg.Delayer.Schedule(WithCopyRequired(WithMinimumDelay(ctx, d)), c, d)
	if serr == nil {
		g.cfg.Logger.Debug("Delivery came back before its retry delay was over; held again for the rest", fields)
		return nil
	}
	return g.copyNotHeld(serr, attempt, fields, "back before its retry delay was over")
}

// copyNotHeld turns the Delayer's refusal of the guard's copy into the
// error the chain settles.
func (g *RedeliveryGuard) copyNotHeld(serr error, attempt int, fields watermill.LogFields, what string) error {
	switch {
	case errors.Is(serr, ErrCannotDelay):
		return &ClassifiedError{
			Err:            fmt.Errorf("%s, and no copy is possible: %w", what, serr),
			Classification: Classification{Action: ActionPoison, Class: ClassUndelayable},
		}
	default:
		// The broker takes no copy (publisher down, alarm, Q refusing): the
		// redelivery cannot be counted, so the message is not run; it goes
		// back to the broker (after the fallback's pause) until a copy can be
		// held. Running it uncounted would let a crash loop, or a failing
		// message whose poison copy is refused, run without limit.
		g.cfg.Logger.Error("Copy of a message the guard did not run not held; returning it to the broker", serr, fields)
		return &ScheduleError{Err: serr, HandlerErr: fmt.Errorf("%s: %w", what, ErrHandlerNotRun), Attempt: attempt}
	}
}
