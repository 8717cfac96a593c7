package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// tiersDelayer implements middleware.Delayer on RabbitMQ for the Tiers mode: it
// publishes the copy to the wait queue of the tier TierFor(delay) of the
// message's originating queue, with mandatory set, and returns once the
// broker confirmed it. The other modes build on it (mode_*.go).
type tiersDelayer struct {
	publisher *confirm.Publisher
	topology  *Topology
	marshaler Marshaler
	queueName func(ctx context.Context) string
	logger    watermill.LoggerAdapter
	// routes checks the broker-side route before the DeadLetterFirst or
	// NativeDelayed mode relies on it (nil: nothing to check).
	routes *routeChecker
}

// Schedule publishes msg to its wait queue and waits for the confirm. A copy
// whose headers exceed amqpwire.MaxCopyHeaderBytes is refused with an error wrapping
// middleware.ErrCannotDelay (the message is then poisoned). The
// tier is TierFor(delay), or, when ctx carries a middleware.MinimumDelay (a
// handler's RetryAfter), the smallest tier at or above it. A delay (or
// RetryAfter) longer than the longest tier is held for the longest tier, and
// the copy carries the rest (retrymeta.SetRemainingDelay): the
// RedeliveryGuard sends it round again when it comes back, as many times as
// needed, so the next attempt never runs earlier than asked. A delay <= 0
// goes straight back to the queue through the loop-back exchange. If the
// wait queue or exchange is missing (returned as unroutable, or 404
// NOT_FOUND), it redeclares the queue's topology and tries once more, so the
// nack that follows a failure still finds the dead-letter path. It does not
// stop when ctx is cancelled (router shutdown): the publish is bounded by the
// publisher's ConfirmTimeout instead, so a retry in flight is not lost to a
// shutdown.
func (d *tiersDelayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	p, err := d.plan(ctx, msg, delay)
	if err != nil {
		return err
	}
	return d.publishPlan(ctx, msg, p)
}

// retryPlan is where Delayer.plan puts a retry copy.
type retryPlan struct {
	queue string // originating queue
	// back: no delay; straight back to queue through the loop-back exchange.
	back bool
	tier time.Duration // the wait queue's tier
	// minimum is the handler's RetryAfter floor (0: none).
	minimum time.Duration
	// remaining is the part of the delay beyond the longest tier, carried
	// by the copy (retrymeta.RemainingDelayKey).
	remaining time.Duration
}

// plan checks the queue's names and chooses msg's wait queue tier; for a
// positive delay it sets msg's remaining delay (retrymeta.SetRemainingDelay).
func (d *tiersDelayer) plan(ctx context.Context, msg *message.Message, delay time.Duration) (retryPlan, error) {
	q := d.queueName(ctx)
	if err := d.topology.CheckNames(q); err != nil {
		return retryPlan{}, err
	}
	if delay <= 0 {
		// Straight back to Q (the RedeliveryGuard's and the fallback's
		// copies), with whatever remaining delay the copy's maker set.
		return retryPlan{queue: q, back: true}, nil
	}
	p := retryPlan{queue: q, tier: d.topology.TierFor(delay)}
	asked := delay
	if minimum, ok := middleware.MinimumDelay(ctx); ok {
		// A handler's RetryAfter is a floor: round up, never down.
		p.minimum = minimum
		asked = max(delay, minimum)
		p.tier, _ = d.topology.tierAtLeast(asked)
	}
	// Beyond the longest tier, the wait queue holds the copy for that tier
	// and the copy carries the rest (retrymeta.RemainingDelayKey): the
	// RedeliveryGuard sends it round again, so it never runs earlier than
	// asked. Within the tiers a backoff delay is rounded to the nearest tier
	// (TierFor), a RetryAfter up (tierAtLeast).
	if n := len(d.topology.tiers); n > 0 && asked > d.topology.tiers[n-1] {
		p.remaining = asked - d.topology.tiers[n-1]
		d.logger.Debug("Retry delay exceeds the longest tier; held in several hops", watermill.LogFields{
			"queue": q, "requested": asked.String(), "tier": p.tier.String(), "remaining": p.remaining.String(),
		})
	}
	retrymeta.SetRemainingDelay(msg.Metadata, p.remaining)
	return p, nil
}

// PlannedDelay returns how long a retry scheduled with ctx and delay waits:
// its tier (TierFor(delay); with a RetryAfter in ctx, the smallest tier at
// or above it), or the whole delay when it is longer than the longest tier
// (held again for the rest). It has no side effects; the retry chain logs
// it as scheduled_delay beside the delay asked.
func (d *tiersDelayer) PlannedDelay(ctx context.Context, delay time.Duration) time.Duration {
	if delay <= 0 || len(d.topology.tiers) == 0 {
		return delay
	}
	asked, tier := delay, d.topology.TierFor(delay)
	if minimum, ok := middleware.MinimumDelay(ctx); ok {
		asked = max(delay, minimum)
		tier, _ = d.topology.tierAtLeast(asked)
	}
	if asked > d.topology.tiers[len(d.topology.tiers)-1] {
		return asked
	}
	return tier
}

// publishPlan publishes msg where p says.
func (d *tiersDelayer) publishPlan(ctx context.Context, msg *message.Message, p retryPlan) error {
	if p.back {
		return d.publish(ctx, msg, d.topology.naming.LoopBackExchange, p.queue, p.queue)
	}
	return d.publish(ctx, msg, d.topology.naming.WaitExchange, d.topology.naming.WaitQueue(p.queue, p.tier), p.queue)
}

// foreignDeathsKey marks, in a delivery's context (Retry.Middleware), a
// delivery with foreignDeaths: its first-tier retry is a published copy,
// not the dead-letter path.
type foreignDeathsKey struct{}

// foreignDeaths reports whether msg carries x-death entries for q that the
// broker did not write on the way back to q (a producer's, or copied from
// another message): the message is not on a retry route
// (retrymeta.DeliveryRetryRouteKey). The dead-letter path would keep them
// (RabbitMQ 3.x adds its own count to an x-death entry the message already
// has), so that such a message's next delivery, back through the first wait
// queue, would count them as attempts; a published copy, whose x-death is
// stripped, counts only the attempts made here.
func foreignDeaths(msg *message.Message, q string) bool {
	if msg.Metadata.Get(retrymeta.DeliveryRetryRouteKey) == "true" {
		return false
	}
	recs, err := amqpwire.ParseXDeath(msg.Metadata.Get(middleware.XDeathKey))
	if err != nil {
		return true
	}
	for _, r := range recs {
		if r.Queue == q {
			return true
		}
	}
	return false
}

// publish marshals msg and publishes it to exchange with key (mandatory,
// confirmed); if the target is missing it redeclares q's topology and tries
// once more.
func (d *tiersDelayer) publish(ctx context.Context, msg *message.Message, exchange, key, q string) error {
	p, err := d.marshaler.Marshal(msg)
	if err != nil {
		return fmt.Errorf("amqpretry: marshaling retry copy: %w", err)
	}
	if n := wire.HeaderBytes(p.Headers); n > amqpwire.MaxCopyHeaderBytes {
		return fmt.Errorf("%w: the retry copy's headers take about %d bytes, more than the %d that stay deliverable once the broker adds x-death",
			middleware.ErrCannotDelay, n, amqpwire.MaxCopyHeaderBytes)
	}
	pctx := context.WithoutCancel(ctx)
	err = d.publisher.PublishRaw(pctx, exchange, key, p)
	if err == nil || !topologyMissing(err) {
		return err
	}
	d.logger.Error("Retry publish found no route; redeclaring topology", err, watermill.LogFields{"queue": q, "exchange": exchange, "routing_key": key})
	if rerr := d.topology.redeclare(d.publisher.Channel, q); rerr != nil {
		return errors.Join(err, fmt.Errorf("amqpretry: redeclaring topology of %q: %w", q, rerr))
	}
	return d.publisher.PublishRaw(pctx, exchange, key, p)
}

// topologyMissing reports a publish that found no route or no exchange
// (returned as unroutable, or 404 NOT_FOUND).
func topologyMissing(err error) bool {
	if errors.Is(err, confirm.ErrUnroutable) {
		return true
	}
	var aerr *amqp.Error
	return errors.As(err, &aerr) && aerr.Code == amqp.NotFound
}
