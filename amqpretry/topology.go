package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/internal/amqperr"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// Queue types for Config.QueueType ("Quorum Queues", "Classic Queues").
const (
	QueueTypeClassic = "classic"
	QueueTypeQuorum  = "quorum"
)

// MaxTTL is the largest queue TTL RabbitMQ accepts: 2^32-1 ms
// ("Time-To-Live and Expiration").
const MaxTTL = time.Duration(1<<32-1) * time.Millisecond

// maxQueueNameBytes is RabbitMQ's limit on queue and exchange names.
const maxQueueNameBytes = 255

// Naming gives the names of the retry topology. Zero fields take the
// defaults shown; the same Naming must be used by every process that shares
// the queues.
type Naming struct {
	// LoopBackExchange is the direct exchange expired retries come back
	// through; each originating queue Q is bound to it with routing key Q, so
	// a retry returns to Q only. Default "rabbitretry.loopback".
	LoopBackExchange string
	// WaitExchange is the direct exchange retries are published to; each
	// wait queue is bound to it with its own name as routing key. No queue
	// argument names it (dead-lettering goes through the default exchange),
	// so it can be renamed between deploys. Default "rabbitretry.wait".
	WaitExchange string
	// PoisonExchange is the direct exchange poison queues are bound to with
	// their own names. Default "rabbitretry.poison".
	PoisonExchange string
	// WaitQueue names Q's wait queue for a delay tier. Default
	// "<Q>.wait.<tier>" with tier as retrymeta.FormatDelay renders it:
	// "500ms", "1s", "2m", "1h".
	WaitQueue func(queue string, tier time.Duration) string
	// PoisonQueue names Q's poison queue. Default "<Q>.poison".
	PoisonQueue func(queue string) string
	// QuarantineQueue names Q's quarantine queue: where the RedeliveryGuard
	// moves a message redelivered in Q (a crash or consumer timeout may
	// have been any of the unacked deliveries), to run it alone (fetched one
	// at a time while nothing else runs) so that a crash there is
	// attributable (retrymeta.Quarantiner). It is
	// bound to LoopBackExchange with its own name and consumed by the
	// subscriber from Retry.NewSubscriber. Default "<Q>.quarantine".
	QuarantineQueue func(queue string) string
}

func (n *Naming) setDefaults() {
	if n.LoopBackExchange == "" {
		n.LoopBackExchange = retrymeta.DefaultLoopBackExchange
	}
	if n.WaitExchange == "" {
		n.WaitExchange = "rabbitretry.wait"
	}
	if n.PoisonExchange == "" {
		n.PoisonExchange = "rabbitretry.poison"
	}
	if n.WaitQueue == nil {
		n.WaitQueue = func(q string, tier time.Duration) string { return q + ".wait." + retrymeta.FormatDelay(tier) }
	}
	if n.PoisonQueue == nil {
		n.PoisonQueue = func(q string) string { return q + ".poison" }
	}
	if n.QuarantineQueue == nil {
		n.QuarantineQueue = func(q string) string { return q + ".quarantine" }
	}
}

// DeclareError is returned when the broker refuses a declare or bind. For a
// PRECONDITION_FAILED (406) on an existing queue whose arguments differ,
// Argument names the argument the broker reported ("inequivalent arg").
type DeclareError struct {
	// Kind is "queue", "exchange" or "binding".
	Kind string
	// Name is the queue or exchange name.
	Name string
	// Argument is the conflicting argument, e.g. "x-dead-letter-exchange",
	// when the broker named one.
	Argument string
	// Wanted and Found are the argument's value as declared and as the
	// existing queue has it, as the broker wrote them ("none", or "the
	// value '1000' of type 'long'"); empty when the broker did not say.
	Wanted, Found string
	Err           error
	// origin: the queue is an originating queue (AdoptQueue can adopt it).
	origin bool
}

// Error names the declared object, the conflicting argument and both values
// if known, the fix, and the broker error.
func (e *DeclareError) Error() string {
	if e.Argument != "" {
		fix := "delete it (its messages are lost) or declare it with the same arguments"
		if e.origin {
			fix = "set amqpretry.Config.AdoptQueue to adopt the queue as it is (its arguments stay; what the retry mode needs is set by a policy), or declare it with the same arguments"
		}
		return fmt.Sprintf("amqpretry: declaring %s %q: argument %s is %s on the existing %s, and the library declares %s; fix: %s: %v",
			e.Kind, e.Name, e.Argument, orUnknown(e.Found), e.Kind, orUnknown(e.Wanted), fix, e.Err)
	}
	return fmt.Sprintf("amqpretry: declaring %s %q: %v", e.Kind, e.Name, e.Err)
}

func orUnknown(s string) string {
	if s == "" {
		return "(not reported)"
	}
	return s
}

// Unwrap returns the broker error (an *amqp.Error for a refused declare).
func (e *DeclareError) Unwrap() error { return e.Err }

func declareError(kind, name string, err error) error {
	if err == nil {
		return nil
	}
	de := &DeclareError{Kind: kind, Name: name, Err: err}
	de.Argument, de.Wanted, de.Found = amqperr.Inequivalent(err)
	return de
}

// Topology declares, for each originating queue Q, the retry topology:
//
//	business exchange --(routing key)--> Q   (quorum: x-dead-letter-exchange = "" (default),
//	                                          x-dead-letter-routing-key = Q.poison; see originArgs)
//	WaitExchange --(Q.wait.<tier>)--> Q.wait.<tier>   (x-message-ttl = tier,
//	                                          x-dead-letter-exchange = "" (default exchange),
//	                                          x-dead-letter-routing-key = Q)
//	LoopBackExchange --(Q)--> Q               (zero-delay copies, replays)
//	PoisonExchange --(Q.poison)--> Q.poison
//
// Wait queues have no consumers: the broker dead-letters each message when
// its queue TTL expires ("Time-To-Live and Expiration", "Dead Letter
// Exchanges"). One queue per tier, with a queue-level TTL, avoids the
// head-of-line blocking of per-message TTL. All declares are idempotent.
//
// Topology implements watermill-amqp's TopologyBuilder, so the subscriber
// declares it (again) on every (re)connect.
type Topology struct {
	naming          Naming
	tiers           []time.Duration
	queueType       string
	deadLetterFirst bool
	native          *NativeDelayedRetry // Q gets the x-delayed-retry-* arguments
	logger          watermill.LoggerAdapter
	// adopt (Config.AdoptQueue): Q is declared passively, its needs go to a
	// policy; open gives the side channel the passive declare runs on.
	adopt *adopter
	open  func() (*amqp.Channel, error)
	// bindQueue and deliveredQueue come from the Custom mode's
	// CustomDelayer (nil without one): bindQueue runs at the end of
	// DeclareRetry, deliveredQueue lets the Marshaler recognise its copies.
	bindQueue      func(ch *amqp.Channel, queue string) error
	deliveredQueue func(exchange, routingKey string) (queue string, ok bool)

	// quarantines: the quarantine subscriptions of this process, per Q.
	quarantines quarantines
	// onBuilt, if set, runs at the end of BuildTopology (the handler
	// deadline of Q is worked out and logged then: Config.HandlerDeadline).
	onBuilt func(queue string)

	mu       sync.Mutex
	declared map[string]declaredQueue // originating queue -> how BuildTopology declared it
}

type declaredQueue struct {
	exchange string
	config   wamqp.Config
}

func newTopology(naming Naming, tiers []time.Duration, queueType string, deadLetterFirst bool, logger watermill.LoggerAdapter) *Topology {
	return &Topology{naming: naming, tiers: tiers, queueType: queueType, deadLetterFirst: deadLetterFirst, logger: logger,
		declared: map[string]declaredQueue{}}
}

// Tiers returns the delay tiers, ascending; none when a Custom mode (e.g. the cascade)
// replaces the wait queues.
func (t *Topology) Tiers() []time.Duration { return slices.Clone(t.tiers) }

// Naming returns the names in use.
func (t *Topology) Naming() Naming { return t.naming }

// TierFor maps a computed delay to the tier that holds it: the nearest tier
// on a logarithmic scale (between tiers a < b the boundary is sqrt(a*b)), so
// the actual wait differs from the computed delay by at most a factor
// sqrt(b/a) (1.41 for doubling tiers), and jittered delays spread over
// neighbouring tiers instead of piling into the next one up. A delay below
// the shortest tier gets the shortest; above the longest, the longest.
// With no tiers (a Custom mode) it returns 0.
func (t *Topology) TierFor(d time.Duration) time.Duration {
	if len(t.tiers) == 0 {
		return 0
	}
	i, found := slices.BinarySearch(t.tiers, d)
	switch {
	case found:
		return t.tiers[i]
	case i == 0:
		return t.tiers[0]
	case i == len(t.tiers):
		return t.tiers[len(t.tiers)-1]
	}
	lo, hi := float64(t.tiers[i-1]), float64(t.tiers[i])
	if float64(d)*float64(d) < lo*hi {
		return t.tiers[i-1]
	}
	return t.tiers[i]
}

// tierAtLeast returns the smallest tier >= d, for delays that are a minimum
// (a handler's RetryAfter): the message never comes back earlier than asked.
// ok is false when d exceeds the longest tier; the longest tier is returned
// then (the Delayer holds the copy for it and the copy carries the rest,
// retrymeta.RemainingDelayKey, so it is held again when it comes back).
// With no tiers (a Custom mode) it returns 0, false.
func (t *Topology) tierAtLeast(d time.Duration) (tier time.Duration, ok bool) {
	if len(t.tiers) == 0 {
		return 0, false
	}
	i, _ := slices.BinarySearch(t.tiers, d)
	if i == len(t.tiers) {
		return t.tiers[len(t.tiers)-1], false
	}
	return t.tiers[i], true
}

// WaitQueues returns Q's wait queue names, one per tier, in tier order.
func (t *Topology) WaitQueues(queue string) []string {
	names := make([]string, len(t.tiers))
	for i, tier := range t.tiers {
		names[i] = t.naming.WaitQueue(queue, tier)
	}
	return names
}

// sideQueues are the queues DeclareRetry declares for Q: its wait queues,
// poison queue and quarantine queue.
func (t *Topology) sideQueues(queue string) []string {
	return append(t.WaitQueues(queue), t.naming.PoisonQueue(queue), t.naming.QuarantineQueue(queue))
}

// CheckNames returns an error naming the first derived queue name longer
// than 255 bytes, or an empty queue name.
func (t *Topology) CheckNames(queue string) error {
	if queue == "" {
		return errors.New("amqpretry: empty originating queue name (server-named queues cannot be retried into)")
	}
	for _, n := range append(t.sideQueues(queue), queue) {
		if len(n) > maxQueueNameBytes {
			return fmt.Errorf("amqpretry: queue name %.60q... is %d bytes, more than RabbitMQ's %d (shorten queue %.60q or set Naming)",
				n, len(n), maxQueueNameBytes, queue)
		}
	}
	return nil
}

// originArgs are the arguments amqpretry sets on the originating queue Q.
//
// The library itself never dead-letters Q's messages (a failure it cannot
// settle is nacked with requeue), except in the DeadLetterFirst mode, so
// what Q's dead-letter exchange receives is what RabbitMQ itself removes:
//   - classic Q: no dead-letter exchange. A per-message or queue TTL that
//     expires in Q, or a max-length overflow, discards the message as the
//     producer or operator asked, instead of a detour through the retry path
//     that ends in the broker's dead-letter cycle detection.
//   - quorum Q: dead-letter exchange = the default exchange, routing key
//     Q's poison queue, at-least-once. Besides expiry and overflow, RabbitMQ
//     4.0+ removes a message past the queue's delivery limit (default 20):
//     it lands in the poison queue with x-death reason delivery_limit instead
//     of being dropped ("Quorum Queues", "Dead Letter Exchanges").
//   - DeadLetterFirst mode (quorum only): dead-letter exchange = the
//     default exchange, routing key Q's first wait queue: the library's nack
//     is the first retry.
//   - NativeDelayed mode (quorum only): x-delayed-retry-type "all",
//     x-delayed-retry-min and -max (ms): the library's nack with requeue is
//     a native retry.
func (t *Topology) originArgs(queue string, user amqp.Table) amqp.Table {
	args := amqp.Table{}
	for k, v := range user {
		args[k] = v
	}
	if t.queueType == QueueTypeQuorum {
		args["x-queue-type"] = QueueTypeQuorum
	}
	for k, v := range t.retryArgs(queue) {
		args[k] = v
	}
	return args
}

// retryArgs are the arguments of Q that the retry mode needs (none for a
// classic queue): declared with Q, or, for an adopted queue (AdoptQueue),
// set by a policy with the same keys without "x-". Every dead-letter target
// goes through the default exchange, which cannot be deleted and depends on
// no exchange name in Naming, so renaming an exchange never changes Q's
// arguments.
func (t *Topology) retryArgs(queue string) amqp.Table {
	args := amqp.Table{}
	if t.queueType != QueueTypeQuorum {
		return args
	}
	args["x-dead-letter-strategy"] = "at-least-once"
	args["x-overflow"] = "reject-publish"
	args["x-dead-letter-exchange"] = ""
	if t.deadLetterFirst {
		args["x-dead-letter-routing-key"] = t.naming.WaitQueue(queue, t.tiers[0])
	} else {
		args["x-dead-letter-routing-key"] = t.naming.PoisonQueue(queue)
	}
	if t.native != nil {
		for k, v := range t.native.args() {
			args[k] = v
		}
	}
	return args
}

// quarantineArgs: like Q's (quorum: what RabbitMQ removes, e.g. past its
// delivery limit, is dead-lettered at-least-once into the poison queue; never
// a delayed retry or a first-retry dead-letter target).
func (t *Topology) quarantineArgs(queue string) amqp.Table {
	args := t.sideQueueArgs()
	if t.queueType == QueueTypeQuorum {
		args["x-dead-letter-strategy"] = "at-least-once"
		args["x-overflow"] = "reject-publish"
		args["x-dead-letter-exchange"] = ""
		args["x-dead-letter-routing-key"] = t.naming.PoisonQueue(queue)
	}
	return args
}

func (t *Topology) sideQueueArgs() amqp.Table {
	args := amqp.Table{}
	if t.queueType == QueueTypeQuorum {
		args["x-queue-type"] = QueueTypeQuorum
	}
	return args
}

func (t *Topology) waitArgs(queue string, tier time.Duration) amqp.Table {
	args := t.sideQueueArgs()
	args["x-message-ttl"] = tier.Milliseconds()
	// Through the default exchange, which cannot be deleted: a waiting retry
	// cannot be lost to a deleted or misconfigured exchange. The default
	// exchange routes by queue name, so the retry reaches Q only.
	args["x-dead-letter-exchange"] = ""
	args["x-dead-letter-routing-key"] = queue
	if t.queueType == QueueTypeQuorum {
		// At-least-once dead-lettering needs reject-publish overflow; with
		// drop-head RabbitMQ silently falls back to at-most-once.
		args["x-dead-letter-strategy"] = "at-least-once"
		args["x-overflow"] = "reject-publish"
	}
	return args
}

// ExchangeDeclare implements wamqp.TopologyBuilder: the business exchange,
// declared as watermill-amqp's DefaultTopologyBuilder does.
func (t *Topology) ExchangeDeclare(ch *amqp.Channel, exchangeName string, config wamqp.Config) error {
	return declareError("exchange", exchangeName, ch.ExchangeDeclare(exchangeName, config.Exchange.Type,
		config.Exchange.Durable, config.Exchange.AutoDeleted, config.Exchange.Internal, config.Exchange.NoWait, config.Exchange.Arguments))
}

// BuildTopology implements wamqp.TopologyBuilder. It declares the
// originating queue with the dead-letter arguments above merged into
// config.Queue.Arguments, the business exchange and binding as
// watermill-amqp does, then DeclareRetry. A refused declare returns a
// *DeclareError; the channel is then closed by the broker.
func (t *Topology) BuildTopology(ch *amqp.Channel, queueName, exchangeName string, config wamqp.Config, logger watermill.LoggerAdapter) error {
	if err := t.CheckNames(queueName); err != nil {
		return err
	}
	if err := t.declareOrigin(ch, queueName, config); err != nil {
		return err
	}
	if exchangeName != "" {
		if err := t.ExchangeDeclare(ch, exchangeName, config); err != nil {
			return err
		}
		if err := ch.QueueBind(queueName, config.QueueBind.GenerateRoutingKey(queueName), exchangeName,
			config.QueueBind.NoWait, config.QueueBind.Arguments); err != nil {
			return declareError("binding", queueName+" <- "+exchangeName, err)
		}
	}
	if err := t.DeclareRetry(ch, queueName); err != nil {
		return err
	}
	t.mu.Lock()
	t.declared[queueName] = declaredQueue{exchange: exchangeName, config: config}
	t.mu.Unlock()
	if t.onBuilt != nil {
		t.onBuilt(queueName)
	}
	return nil
}

// declareOrigin declares Q with the arguments the retry mode needs; an
// adopted Q (Config.AdoptQueue) that exists is left as it is, one that does
// not is declared without the retry arguments, and the policy is applied.
func (t *Topology) declareOrigin(ch *amqp.Channel, queue string, config wamqp.Config) error {
	durable := config.Queue.Durable || t.queueType == QueueTypeQuorum
	if t.adopt == nil {
		_, err := ch.QueueDeclare(queue, durable, config.Queue.AutoDelete, config.Queue.Exclusive, config.Queue.NoWait,
			t.originArgs(queue, config.Queue.Arguments))
		if de, ok := declareError("queue", queue, err).(*DeclareError); ok {
			de.origin = true
			return de
		}
		return nil
	}
	exists, err := t.queueExists(queue)
	if err != nil {
		return err
	}
	if !exists {
		args := amqp.Table{}
		for k, v := range config.Queue.Arguments {
			args[k] = v
		}
		if t.queueType == QueueTypeQuorum {
			args["x-queue-type"] = QueueTypeQuorum
		}
		if _, err := ch.QueueDeclare(queue, durable, config.Queue.AutoDelete, config.Queue.Exclusive, config.Queue.NoWait, args); err != nil {
			return declareError("queue", queue, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return t.adopt.adopt(ctx, queue)
}

// queueExists declares queue passively on a channel of its own (a missing
// queue closes the channel: 404 NOT_FOUND).
func (t *Topology) queueExists(queue string) (bool, error) {
	ch, err := t.open()
	if err != nil {
		return false, fmt.Errorf("amqpretry: adopting queue %q: opening a channel: %w", queue, err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil); err != nil {
		var aerr *amqp.Error
		if errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
			return false, nil
		}
		return false, fmt.Errorf("amqpretry: adopting queue %q: %w", queue, err)
	}
	return true, nil
}

// DeclareRetry declares Q's side of the retry topology (loop-back binding,
// wait exchange and queues, poison exchange and queue, quarantine queue
// bound to the loop-back exchange), not Q itself, then
// runs the Custom mode's BindQueue hook for Q, if any (with a
// Custom mode there are no tiers, so no wait queue is declared). All
// exchanges and queues are durable: RabbitMQ 4.3 refuses non-durable shared
// queues, and waiting messages must survive a broker restart.
func (t *Topology) DeclareRetry(ch *amqp.Channel, queue string) error {
	if err := t.CheckNames(queue); err != nil {
		return err
	}
	for _, ex := range []string{t.naming.LoopBackExchange, t.naming.WaitExchange, t.naming.PoisonExchange} {
		if err := ch.ExchangeDeclare(ex, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
			return declareError("exchange", ex, err)
		}
	}
	if err := ch.QueueBind(queue, queue, t.naming.LoopBackExchange, false, nil); err != nil {
		return declareError("binding", queue+" <- "+t.naming.LoopBackExchange, err)
	}
	for _, tier := range t.tiers {
		wq := t.naming.WaitQueue(queue, tier)
		if _, err := ch.QueueDeclare(wq, true, false, false, false, t.waitArgs(queue, tier)); err != nil {
			return declareError("queue", wq, err)
		}
		if err := ch.QueueBind(wq, wq, t.naming.WaitExchange, false, nil); err != nil {
			return declareError("binding", wq+" <- "+t.naming.WaitExchange, err)
		}
	}
	pq := t.naming.PoisonQueue(queue)
	if _, err := ch.QueueDeclare(pq, true, false, false, false, t.sideQueueArgs()); err != nil {
		return declareError("queue", pq, err)
	}
	if err := ch.QueueBind(pq, pq, t.naming.PoisonExchange, false, nil); err != nil {
		return declareError("binding", pq+" <- "+t.naming.PoisonExchange, err)
	}
	qq := t.naming.QuarantineQueue(queue)
	if _, err := ch.QueueDeclare(qq, true, false, false, false, t.quarantineArgs(queue)); err != nil {
		return declareError("queue", qq, err)
	}
	if err := ch.QueueBind(qq, qq, t.naming.LoopBackExchange, false, nil); err != nil {
		return declareError("binding", qq+" <- "+t.naming.LoopBackExchange, err)
	}
	if t.bindQueue != nil {
		if err := t.bindQueue(ch, queue); err != nil {
			return fmt.Errorf("amqpretry: binding %q to the custom delayer (a Custom mode): %w", queue, err)
		}
	}
	return nil
}

// redeclare declares again the whole topology of an originating queue that
// BuildTopology declared before (e.g. after a wait queue was deleted), on a
// channel from open. It returns an error for a queue never declared here.
func (t *Topology) redeclare(open func() (*amqp.Channel, error), queue string) error {
	t.mu.Lock()
	dq, ok := t.declared[queue]
	t.mu.Unlock()
	ch, err := open()
	if err != nil {
		return err
	}
	defer ch.Close()
	if !ok {
		return t.DeclareRetry(ch, queue)
	}
	return t.BuildTopology(ch, queue, dq.exchange, dq.config, t.logger)
}
