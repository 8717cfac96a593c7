package cascadecore

import (
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

// Mode is the retry mode (amqpretry.Config.Mode) that makes amqpretry.New
// schedule its retries through the delay cascade instead of per-queue wait
// queues: amqpretry.Custom(DelayerFactory(cfg)).
//
//	retry, err := amqpretry.New(amqpretry.Config{
//		Subscriber: wamqp.NewDurableQueueConfig(uri),
//		Mode:       cascade.Mode(cascade.Config{}),
//	})
//
// See DelayerFactory for what it does.
func Mode(cfg Config) amqpretry.Mode { return amqpretry.Custom(DelayerFactory(cfg)) }

// DelayerFactory returns the amqpretry.DelayerFactory behind Mode: the
// cascade as an amqpretry.Custom mode. A retry then waits exactly its delay, max(computed backoff, the
// handler's middleware.RetryAfter), rounded up to cfg.Grain (100 ms by
// default), in the vhost's shared level queues, and comes back to its
// originating queue Q only; no wait queue is declared for Q (see
// amqpretry.Custom).
//
// cfg.Publisher and cfg.URI must be empty: the Delayer publishes with the
// Retry's publisher. cfg.Marshaler (if zero), cfg.QueueName and cfg.Logger
// (if nil) default to the Retry's, so a retry goes back to the queue
// amqpretry.Config.QueueName names. Prefix, Grain, Levels and QueueType
// keep their Config defaults and must match every other process using the
// vhost's cascade.
//
// Topology: on every subscriber (re)connect, the topology builder declares
// the cascade (Config.Declare, idempotent) and binds Q to the delivery
// exchange (Config.BindDestination) on the subscriber's channel, so a
// recreated Q is bound again before it consumes; a refused declare (a
// cascade declared elsewhere with other arguments: PRECONDITION_FAILED, an
// *amqpretry.DeclareError) makes the subscriber fail to start. The
// Marshaler recognises a delivery from the cascade (Config.DeliveredQueue:
// a level exchange or the delivery exchange, and a cascade key) as a
// retry-path delivery, so the origin metadata recorded on the first failure
// (middleware.OriginalQueueKey = Q, ...) is kept.
//
// Copies with no delay (the fallback's and the RedeliveryGuard's) do not
// use the cascade: amqpretry sends them through its loop-back exchange.
// The factory returns Validate's error, or an error if Publisher or URI is
// set; New wraps it.
func DelayerFactory(cfg Config) amqpretry.DelayerFactory {
	return func(deps amqpretry.DelayerDeps) (amqpretry.CustomDelayer, error) {
		if cfg.Publisher != nil || cfg.URI != "" {
			return amqpretry.CustomDelayer{}, errors.New("cascade.Mode: leave Config.Publisher and Config.URI empty: the Retry's publisher is used")
		}
		cfg.Publisher = deps.Publisher
		if cfg.Marshaler.Inner == nil && cfg.Marshaler.MaxHeaderBytes == 0 && cfg.Marshaler.Topology == nil {
			cfg.Marshaler = deps.Marshaler
		}
		if cfg.QueueName == nil {
			cfg.QueueName = deps.QueueName
		}
		if cfg.Logger == nil {
			cfg.Logger = deps.Logger
		}
		d, err := NewDelayer(cfg)
		if err != nil {
			return amqpretry.CustomDelayer{}, err
		}
		return amqpretry.CustomDelayer{
			Delayer:        d,
			BindQueue:      d.c.bindOn,
			DeliveredQueue: d.c.deliveredQueue,
			Close:          d.Close,
		}, nil
	}
}

// bindOn declares the cascade and binds queue on ch (the subscriber's
// topology channel), and records both, so the first Schedule for queue
// needs no declare of its own.
func (c *core) bindOn(ch *amqp.Channel, queue string) error {
	c.mu.Lock()
	first := !c.declared
	c.mu.Unlock()
	if first {
		// On the publisher's channel first: finds level queues of an
		// earlier version (core.declare) without closing ch.
		if err := c.ensureBound(queue, true); err != nil {
			return err
		}
	}
	cfg := c.cfg
	cfg.legacyLevels = c.legacy.Load()
	if err := cfg.Declare(ch); err != nil {
		return err
	}
	if err := c.cfg.BindDestination(ch, queue); err != nil {
		return err
	}
	c.mu.Lock()
	c.declared = true
	c.bound[queue] = true
	c.mu.Unlock()
	return nil
}

// deliveredQueue is Config.DeliveredQueue without the delay, on the
// resolved Config (no per-delivery Validate).
func (c *core) deliveredQueue(exchange, routingKey string) (string, bool) {
	if !c.cfg.isCascadeExchange(exchange) {
		return "", false
	}
	_, q, err := c.cfg.parseKey(routingKey)
	return q, err == nil
}
