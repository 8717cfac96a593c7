package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// RedeliveryGuardConfig configures a RedeliveryGuard.
type RedeliveryGuardConfig struct {
	// Delayer takes the counted copy of a redelivered message with delay 0
	// (amqpretry publishes it to the origin queue through the loop-back
	// exchange, confirmed). Required.
	Delayer Delayer
	// MaxRedeliveries bounds the crashes (runs that ended in a redelivery:
	// a consumer crash, a connection loss, a consumer timeout) a message may
	// cause: the redelivery that brings its count (rabbitretry-redeliveries) to
	// MaxRedeliveries poisons it (class ClassRedeliveryLimit) without running
	// the handler again, if that redelivery is attributable to the message
	// (see Quarantiner). With a quarantine, only redeliveries in the
	// quarantine are counted, and the one that brings the count to
	// MaxRedeliveries-1 (at least 1) poisons it: the crash that sent it there
	// may have been its own, so a message that crashes every time crashes
	// at most MaxRedeliveries times (MaxRedeliveries 1: twice).
	// Default 3; range [1, MaxAttemptsCap].
	MaxRedeliveries int
	// QueueName names the originating queue (for logs). Default: the router's
	// subscribe topic.
	QueueName func(ctx context.Context) string
	// Logger logs each redelivery at Info. Default NopLogger.
	Logger watermill.LoggerAdapter
	// RedeliveriesCounted: the attempt sources already count every
	// redelivery as an attempt (amqpwire.AcquiredCountSource, amqpretry's native
	// delayed retry, where each retry is a redelivery). The guard then lets
	// redelivered messages run like any other, without a copy (a copy would
	// undo the broker's delay) and without MaxRedeliveries: MaxAttempts
	// bounds crash loops instead. Default false.
	RedeliveriesCounted bool
}

func (c *RedeliveryGuardConfig) setDefaults() {
	if c.MaxRedeliveries == 0 {
		c.MaxRedeliveries = retrymeta.DefaultMaxRedeliveries
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
// rabbitretry-delivery-redelivered set is not handed to the handler; instead a copy
// with rabbitretry-redeliveries incremented (attempt number, payload and metadata
// unchanged) is handed to the Delayer with delay 0, and the redelivered
// original is acked once the copy is held (confirmed). The copy then runs as
// usual. A redelivery does not consume an attempt: the flag cannot tell a
// handler that crashed from a delivery that sat unprocessed in a consumer's
// prefetch buffer when its channel closed.
//
// Early deliveries: a delivery that came back through the library's retry
// path before its whole delay was over (a RetryAfter or backoff delay longer
// than the Delayer's longest hold, see rabbitretry-remaining-delay-ms) is not run either,
// and is not counted as a redelivery or an attempt (the handler never saw
// it): a copy with the same attempt number and redelivery count is handed to
// the Delayer for the remaining delay (with MinimumDelay set, so a tiered
// Delayer rounds up, and retrymeta.CopyRequired), and the original is acked once
// the copy is held. This check comes first, also for a redelivered delivery
// and with RedeliveriesCounted. The errors are the same as for a
// redelivery's copy.
//
// Crashes are counted against the message that crashed, not against its
// neighbours: when the Delayer is a Quarantiner with a quarantine consumer,
// a message redelivered in its own queue (where the crash may have been any
// of the deliveries the consumer held, or a graceful stop returned it
// unstarted) is moved, as a copy with its count unchanged, to the
// quarantine queue, where it runs alone (amqpretry fetches one message at a
// time, only while nothing else runs), so a redelivery there is its own
// crash or consumer timeout. Only such an attributable redelivery counts
// and can poison it: the one that brings its count to MaxRedeliveries-1 (at
// least 1; see MaxRedeliveries) returns an error classified
// ActionPoison and class ClassRedeliveryLimit (the forwarder poisons it); an
// earlier one puts it back into the quarantine with the count raised. A message that
// runs in the quarantine and succeeds is acked; a failure takes the normal
// retry path (back to its own queue through the Delayer). Without a
// quarantine every redelivery counts. The library does not rely on the
// broker's quorum delivery limit (default 20 on RabbitMQ 4.x, which can
// discard a whole prefetch group): each move is a fresh message.
//
// ErrCannotDelay from the Delayer poisons it as ClassUndelayable. If the
// copy cannot be held for any other reason (publisher closed, broker alarm),
// it returns a schedule error saying the handler did not run: the
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

// Middleware runs h for deliveries that are not redelivered; see
// RedeliveryGuard for the others.
func (g *RedeliveryGuard) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if d := retrymeta.RemainingDelay(msg); d > 0 {
			return nil, g.onEarly(msg, d)
		}
		if !g.cfg.RedeliveriesCounted && msg.Metadata.Get(retrymeta.DeliveryRedeliveredKey) != "" {
			return nil, g.onRedelivered(msg)
		}
		return h(msg)
	}
}

//go:noinline
func (g *RedeliveryGuard) onRedelivered(msg *message.Message) error {
	ctx := msg.Context()
	attempt := Attempt(msg)
	n := retrymeta.Redeliveries(msg) + 1
	fields := watermill.LogFields{
		"message_uuid": msg.UUID, "queue": g.cfg.QueueName(ctx), "attempt": attempt, "redeliveries": n,
	}
	q, _ := g.cfg.Delayer.(retrymeta.Quarantiner)
	quarantined := msg.Metadata.Get(retrymeta.DeliveryQuarantineKey) != ""
	c := retrymeta.CloneMessage(msg)
	retrymeta.StripDeliveryMetadata(c.Metadata)
	setCopyAttempts(c, msg, attempt)
	limit := g.cfg.MaxRedeliveries
	if q != nil && !quarantined {
		// Not attributable: the crash may have been a neighbour's, or a
		// graceful stop returned it unstarted. Move it to the quarantine,
		// where it runs alone, with its count unchanged.
		if n > 1 {
			c.Metadata.Set(retrymeta.RedeliveriesKey, strconv.Itoa(n-1))
		} else {
			delete(c.Metadata, retrymeta.RedeliveriesKey)
		}
		qerr := q.Quarantine(ctx, c)
		switch {
		case qerr == nil:
			fields["redeliveries"] = n - 1
			g.cfg.Logger.Info("Redelivered message moved to the quarantine queue", fields)
			return nil
		case errors.Is(qerr, retrymeta.ErrNoQuarantine):
			q = nil // count it here, as without a quarantine
		default:
			return g.copyNotHeld(qerr, attempt, fields, "redelivered")
		}
	}
	c.Metadata.Set(retrymeta.RedeliveriesKey, strconv.Itoa(n))
	if q != nil {
		// Attributable, in the quarantine. The crash that sent it there
		// (outside, uncounted) may have been its own: one fewer here keeps
		// a message that crashes every time to MaxRedeliveries crashes.
		limit = max(limit-1, 1)
	}
	if n >= limit {
		return &classifiedError{
			Err: fmt.Errorf("redelivered %d times (MaxRedeliveries %d): it crashed, timed out or was returned by its consumer each time",
				n, g.cfg.MaxRedeliveries),
			Classification: Classification{Action: ActionPoison, Class: ClassRedeliveryLimit},
		}
	}
	var serr error
	if q != nil {
		serr = q.Quarantine(ctx, c) // attributable: counted, and it stays in the quarantine
		if errors.Is(serr, retrymeta.ErrNoQuarantine) {
			serr = g.cfg.Delayer.Schedule(ctx, c, 0)
		}
	} else {
		serr = g.cfg.Delayer.Schedule(ctx, c, 0)
	}
	if serr != nil {
		return g.copyNotHeld(serr, attempt, fields, "redelivered")
	}
	g.cfg.Logger.Info("Redelivered message counted and requeued as a copy", fields)
	return nil
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
	c := retrymeta.CloneMessage(msg) // without rabbitretry-remaining-delay-ms: the Delayer writes what it cannot hold
	retrymeta.StripDeliveryMetadata(c.Metadata)
	setCopyAttempts(c, msg, attempt)
	serr := g.cfg.Delayer.Schedule(retrymeta.WithCopyRequired(retrymeta.WithMinimumDelay(ctx, d)), c, d)
	if serr == nil {
		g.cfg.Logger.Debug("Delivery came back before its retry delay was over; held again for the rest", fields)
		return nil
	}
	return g.copyNotHeld(serr, attempt, fields, "back before its retry delay was over")
}

// copyNotHeld turns the Delayer's refusal of the guard's copy into the
// error the chain settles. ErrCannotDelay poisons the message
// (ClassUndelayable). Otherwise the broker takes no copy (publisher down,
// alarm, a queue refusing): the redelivery cannot be counted, so the message
// is not run; it goes back to the broker (after the fallback's pause) until
// a copy can be held. Running it uncounted would let a crash loop, or a
// failing message whose poison copy is refused, run without limit.
func (g *RedeliveryGuard) copyNotHeld(serr error, attempt int, fields watermill.LogFields, what string) error {
	if errors.Is(serr, ErrCannotDelay) {
		return &classifiedError{
			Err:            fmt.Errorf("%s, and no copy is possible: %w", what, serr),
			Classification: Classification{Action: ActionPoison, Class: ClassUndelayable},
		}
	}
	msg := "Copy of a redelivered message not held; returning it to the broker"
	if what != "redelivered" {
		msg = "Copy of a delivery " + what + " not held; returning it to the broker"
	}
	g.cfg.Logger.Error(msg, serr, fields)
	return &chainerr.ScheduleError{Err: serr, HandlerErr: fmt.Errorf("%s: %w", what, chainerr.ErrHandlerNotRun), Attempt: attempt}
}

// setCopyAttempts writes, on c, a copy of msg that carries msg's count
// unchanged (no run happened), msg's attempt number and its proven part.
func setCopyAttempts(c, msg *message.Message, attempt int) {
	c.Metadata.Set(AttemptKey, strconv.Itoa(attempt))
	c.Metadata.Set(retrymeta.ProvenAttemptKey, strconv.Itoa(min(ProvenAttempt(msg), attempt)))
}
