package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// quarantines counts, per originating queue, the quarantine subscriptions
// running in this process (Retry.NewSubscriber): the RedeliveryGuard moves a
// redelivered message to Q's quarantine only while one consumes it, so a
// subscriber built from SubscriberConfig alone never strands messages there.
type quarantines struct {
	mu sync.Mutex
	n  map[string]int
}

func (q *quarantines) add(queue string, d int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.n == nil {
		q.n = map[string]int{}
	}
	q.n[queue] += d
	if q.n[queue] <= 0 {
		delete(q.n, queue)
	}
}

func (q *quarantines) consumed(queue string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n[queue] > 0
}

// Quarantine implements retrymeta.Quarantiner: it publishes msg to the
// quarantine queue of its originating queue through the loop-back exchange
// (mandatory, confirmed; a missing queue is redeclared once) and returns
// once the broker confirmed it. It returns an error wrapping
// retrymeta.ErrNoQuarantine when no subscriber of this process consumes
// that quarantine (the subscriber did not come from Retry.NewSubscriber).
func (d *Delayer) Quarantine(ctx context.Context, msg *message.Message) error {
	q := d.queueName(ctx)
	if err := d.topology.CheckNames(q); err != nil {
		return err
	}
	if !d.topology.quarantines.consumed(q) {
		return fmt.Errorf("amqpretry: queue %q: %w", q, retrymeta.ErrNoQuarantine)
	}
	qq := d.topology.QuarantineQueue(q)
	return d.publish(ctx, msg, d.topology.naming.LoopBackExchange, qq, q)
}

// Quarantine implements retrymeta.Quarantiner through the loop-back path.
func (s splitDelayer) Quarantine(ctx context.Context, msg *message.Message) error {
	return s.loopBack.Quarantine(ctx, msg)
}

// quarantineSubscriber consumes, for each subscribed topic, the originating
// queue (the user's subscriber configuration) and its quarantine queue (the
// same configuration with prefetch 1), and hands out the messages of both on
// one channel; quarantine messages carry retrymeta.DeliveryQuarantineKey.
type quarantineSubscriber struct {
	origin, quarantine *wamqp.Subscriber
	topo               *Topology
	queueName          func(topic string) string

	done    chan struct{} // closed by Close
	mu      sync.Mutex
	closed  bool
	release []func()
}

func newQuarantineSubscriber(cfg wamqp.Config, topo *Topology, logger watermill.LoggerAdapter) (*quarantineSubscriber, error) {
	origin, err := wamqp.NewSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	gen := cfg.Queue.GenerateName
	qcfg := cfg
	qcfg.Queue.GenerateName = func(topic string) string { return topo.QuarantineQueue(gen(topic)) }
	qcfg.Queue.Arguments = nil
	qcfg.Consume.Qos.PrefetchCount = 1 // alone on its channel: a redelivery is the message's own
	qcfg.Consume.Qos.PrefetchSize = 0
	qcfg.Consume.Consumer = ""
	qcfg.Consume.Arguments = maps.Clone(cfg.Consume.Arguments)
	// watermill-amqp passes Exchange.GenerateName(topic) to BuildTopology:
	// here the originating queue, whose side topology quarantineTopology
	// declares; nothing is bound to the business exchange.
	qcfg.Exchange.GenerateName = gen
	qcfg.TopologyBuilder = quarantineTopology{topo: topo}
	if a := cfg.Connection.AmqpConfig; a != nil {
		ac := *a
		ac.Properties = maps.Clone(a.Properties)
		if name, ok := ac.Properties["connection_name"].(string); ok && name != "" {
			ac.Properties["connection_name"] = name + ".quarantine"
		}
		qcfg.Connection.AmqpConfig = &ac
	}
	quarantine, err := wamqp.NewSubscriber(qcfg, logger)
	if err != nil {
		_ = origin.Close()
		return nil, err
	}
	return &quarantineSubscriber{origin: origin, quarantine: quarantine, topo: topo, queueName: gen, done: make(chan struct{})}, nil
}

// quarantineTopology declares the side topology of the originating queue
// (Topology.DeclareRetry: the quarantine queue is part of it) for the
// quarantine subscription, without binding anything to the business
// exchange.
type quarantineTopology struct{ topo *Topology }

func (q quarantineTopology) ExchangeDeclare(*amqp.Channel, string, wamqp.Config) error { return nil }

func (q quarantineTopology) BuildTopology(ch *amqp.Channel, _, origin string, _ wamqp.Config, _ watermill.LoggerAdapter) error {
	return q.topo.DeclareRetry(ch, origin)
}

// Subscribe consumes topic's originating queue and its quarantine.
func (s *quarantineSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.origin.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	qin, err := s.quarantine.Subscribe(ctx, topic)
	if err != nil {
		return nil, errors.Join(err, s.origin.Close())
	}
	queue := s.queueName(topic)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("amqpretry: subscriber closed")
	}
	var once sync.Once
	s.topo.quarantines.add(queue, 1)
	s.release = append(s.release, func() { once.Do(func() { s.topo.quarantines.add(queue, -1) }) })
	s.mu.Unlock()

	out := make(chan *message.Message)
	var wg sync.WaitGroup
	// gate: a quarantine message runs alone in this subscription; an origin
	// message waits for it, and it waits until the origin message in flight
	// is settled and its ack written. So a crash while it runs is its own,
	// and the ack of an origin delivery the guard just moved into the
	// quarantine is on the wire before the copy runs.
	var gate sync.RWMutex
	pass := func(in <-chan *message.Message, quarantined bool) {
		defer wg.Done()
		lock, unlock := gate.RLock, gate.RUnlock
		if quarantined {
			lock, unlock = gate.Lock, gate.Unlock
		}
		for msg := range in {
			if quarantined {
				msg.Metadata.Set(retrymeta.DeliveryQuarantineKey, "true")
			}
			// watermill-amqp cancels the context it gave the message once it
			// has written the ack or nack to the broker (its processMessage
			// returned): waiting for it, not just for the router's ack,
			// closes the window in which a crash could lose the ack.
			settled := msg.Context().Done()
			lock()
			select {
			case out <- msg:
				select {
				case <-msg.Acked():
				case <-msg.Nacked():
				case <-s.done:
				}
				select {
				case <-settled:
				case <-s.done:
				}
			case <-s.done:
				msg.Nack() // not handed out: back to the broker, unprocessed
			}
			unlock()
		}
	}
	wg.Add(2)
	go pass(in, false)
	go pass(qin, true)
	go func() {
		wg.Wait()
		close(out)
	}()
	return out, nil
}

// SubscribeInitialize declares the originating queue's topology (the
// quarantine queue included).
func (s *quarantineSubscriber) SubscribeInitialize(topic string) error {
	return s.origin.SubscribeInitialize(topic)
}

// Close closes both subscribers; the quarantine no longer counts as
// consumed by this process.
func (s *quarantineSubscriber) Close() error {
	s.mu.Lock()
	if !s.closed {
		close(s.done)
	}
	s.closed = true
	release := s.release
	s.release = nil
	s.mu.Unlock()
	for _, r := range release {
		r()
	}
	return errors.Join(s.origin.Close(), s.quarantine.Close())
}
