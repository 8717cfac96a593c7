package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Custom is the retry mode that replaces the wait queues by another delay
// mechanism for every retry with a positive delay, e.g. the delay cascade
// (cascade.Mode), which delivers after the exact delay (to its grain)
// instead of rounding it to a tier. New calls factory once, after
// connecting the retry publisher (see DelayerFactory, CustomDelayer); its
// error is returned wrapped. Copies with no delay (the fallback's and the
// RedeliveryGuard's) still go back to their queue through the loop-back
// exchange. No wait queue is declared (Topology has no tiers: TierFor
// returns 0). Wait queues declared by an earlier deploy with tiers are left
// alone (Topology.Inspect reports them as orphans; TidyOrphans deletes them
// once empty). A nil factory is refused by Validate.
func Custom(factory DelayerFactory) Mode { return customMode{factory: factory} }

type customMode struct{ factory DelayerFactory }

func (customMode) String() string { return "custom" }

func (m customMode) validate(*Config) error {
	if m.factory == nil {
		return errors.New("amqpretry.Config.Mode Custom has a nil DelayerFactory")
	}
	return nil
}

func (customMode) configure(*Config, *Topology) {} // no wait queue

func (m customMode) delayer(base *tiersDelayer, deps DelayerDeps) (middleware.Delayer, func() error, error) {
	custom, err := buildCustomDelayer(m.factory, deps, base.topology)
	if err != nil {
		return nil, nil, fmt.Errorf("amqpretry: Config.Mode Custom: %w", err)
	}
	return splitDelayer{loopBack: base, custom: custom.Delayer}, custom.Close, nil
}

// DelayerDeps is what New hands a Custom mode's DelayerFactory: the pieces of the
// Retry a delay mechanism of its own needs to publish retry copies.
type DelayerDeps struct {
	// Publisher is the Retry's confirm publisher (mandatory, publisher
	// confirms). The factory's Delayer may publish with it and open
	// channels on it (Channel); it must not close it (Retry.Close does).
	Publisher *confirm.Publisher
	// Marshaler is the Retry's x-death-aware Marshaler (its Topology set):
	// marshal retry copies with it.
	Marshaler Marshaler
	// QueueName maps a message's context to its originating queue
	// (Config.QueueName, defaulted): a retry goes back to that queue.
	QueueName func(ctx context.Context) string
	// Logger is Config.Logger (defaulted; never nil).
	Logger watermill.LoggerAdapter
}

// CustomDelayer is what a DelayerFactory returns: the delay mechanism that
// replaces amqpretry's wait queues for retries with a positive delay.
type CustomDelayer struct {
	// Delayer schedules every retry copy with a delay > 0 (or with a
	// positive middleware.MinimumDelay in its context, a handler's
	// RetryAfter). It must honour middleware.MinimumDelay as a floor, return
	// nil only once the broker holds the copy, and wrap
	// middleware.ErrCannotDelay for a copy it can never delay (the message
	// is then poisoned). Required.
	//
	// Copies with no delay (delay <= 0 and no minimum: the fallback's and
	// the RedeliveryGuard's) do not reach it: they keep going straight back
	// to their queue through the loop-back exchange, as with the tiers, so
	// they do not depend on the custom mechanism being healthy.
	Delayer middleware.Delayer
	// BindQueue, if set, runs for each originating queue Q each time the
	// topology builder declares Q's retry topology (DeclareRetry: on every
	// subscriber (re)connect, and on a redeclare after a publish found the
	// topology missing), on the same channel, after Q and its loop-back
	// binding exist. An error fails the declare (the subscriber does not
	// start; an *amqp.Error from the broker closes ch). Use it to declare
	// the mechanism's shared topology and route to Q.
	BindQueue func(ch *amqp.Channel, queue string) error
	// DeliveredQueue, if set, recognises a delivery that came back to its
	// queue through the mechanism, from basic.deliver's exchange and
	// routing key: it returns the queue the copy was addressed to and true,
	// else false. The Marshaler then treats such a delivery as a retry-path
	// delivery (retrymeta.DeliveryRetryPathKey), so that the origin
	// metadata (middleware.OriginalQueueKey, OriginalExchangeKey,
	// OriginalRoutingKeyKey) recorded on the first failure is kept. Without
	// it, a retried delivery whose routing key is not the queue name gets
	// the mechanism's exchange and key as its origin.
	DeliveredQueue func(exchange, routingKey string) (queue string, ok bool)
	// Close, if set, is called by Retry.Close before the retry publisher is
	// closed (the router must be closed first). Its error is returned
	// joined with the publisher's.
	Close func() error
}

// DelayerFactory builds a CustomDelayer for New (the Custom mode).
// It is called once, after the retry publisher is connected; an error
// makes New fail (the publisher is closed). The delay cascade is one:
// cascade.Mode is Custom around its factory.
type DelayerFactory func(DelayerDeps) (CustomDelayer, error)

// splitDelayer sends copies with no delay through amqpretry's loop-back
// path and everything else to the custom Delayer.
type splitDelayer struct {
	loopBack *tiersDelayer
	custom   middleware.Delayer
}

// Schedule implements middleware.Delayer.
func (s splitDelayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	if minimum, ok := middleware.MinimumDelay(ctx); delay <= 0 && (!ok || minimum <= 0) {
		q := s.loopBack.queueName(ctx)
		if err := s.loopBack.topology.CheckNames(q); err != nil {
			return err
		}
		return s.loopBack.publish(ctx, msg, s.loopBack.topology.naming.LoopBackExchange, q, q)
	}
	return s.custom.Schedule(ctx, msg, delay)
}

// buildCustomDelayer runs factory and wires its hooks into topo.
func buildCustomDelayer(factory DelayerFactory, deps DelayerDeps, topo *Topology) (CustomDelayer, error) {
	cd, err := factory(deps)
	if err != nil {
		return CustomDelayer{}, err
	}
	if cd.Delayer == nil {
		if cd.Close != nil {
			_ = cd.Close()
		}
		return CustomDelayer{}, errors.New("the DelayerFactory returned no Delayer")
	}
	topo.bindQueue = cd.BindQueue
	topo.deliveredQueue = cd.DeliveredQueue
	return cd, nil
}
