package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// quarantines counts, per originating queue, the quarantine subscriptions
// running in this process (Retry.NewSubscriber): the RedeliveryGuard moves a
// redelivered message to Q's quarantine only while one consumes it, so a
// subscriber built from SubscriberConfig alone never strands messages there.
type quarantines struct {
	mu sync.Mutex
	n  map[string][]chan struct{} // per queue, one wake channel per subscription
}

// add registers a subscription consuming queue's quarantine and returns the
// channel that wake signals.
func (q *quarantines) add(queue string) chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.n == nil {
		q.n = map[string][]chan struct{}{}
	}
	c := make(chan struct{}, 1)
	q.n[queue] = append(q.n[queue], c)
	return c
}

// remove unregisters the subscription whose wake channel is c.
func (q *quarantines) remove(queue string, c chan struct{}) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.n[queue] = slices.DeleteFunc(q.n[queue], func(o chan struct{}) bool { return o == c })
	if len(q.n[queue]) == 0 {
		delete(q.n, queue)
	}
}

func (q *quarantines) consumed(queue string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.n[queue]) > 0
}

// wake tells queue's quarantine subscriptions that a message was moved
// there, so that one fetches it now instead of at its next poll.
func (q *quarantines) wake(queue string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, c := range q.n[queue] {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

// Quarantine implements retrymeta.Quarantiner: it publishes msg to the
// quarantine queue of its originating queue through the loop-back exchange
// (mandatory, confirmed; a missing queue is redeclared once) and returns
// once the broker confirmed it. It returns an error wrapping
// retrymeta.ErrNoQuarantine when no subscriber of this process consumes
// that quarantine (the subscriber did not come from Retry.NewSubscriber).
func (d *tiersDelayer) Quarantine(ctx context.Context, msg *message.Message) error {
	q := d.queueName(ctx)
	if err := d.topology.CheckNames(q); err != nil {
		return err
	}
	if !d.topology.quarantines.consumed(q) {
		return fmt.Errorf("amqpretry: queue %q: %w", q, retrymeta.ErrNoQuarantine)
	}
	qq := d.topology.naming.QuarantineQueue(q)
	if err := d.publish(ctx, msg, d.topology.naming.LoopBackExchange, qq, q); err != nil {
		return err
	}
	d.topology.quarantines.wake(q)
	return nil
}

// Quarantine implements retrymeta.Quarantiner through the loop-back path.
func (s splitDelayer) Quarantine(ctx context.Context, msg *message.Message) error {
	return s.loopBack.Quarantine(ctx, msg)
}

// quarantinePollInterval is how often a quarantine subscription
// (Retry.NewSubscriber) looks for messages in its quarantine queue that it
// was not told about: left there by an earlier run or by another process.
// A message this process moves there is fetched at once.
const quarantinePollInterval = time.Second

// quarantineSubscriber consumes, for each subscribed topic, the originating
// queue (the user's subscriber configuration, watermill-amqp) and its
// quarantine queue, and hands out the messages of both on one channel;
// quarantine messages carry retrymeta.DeliveryQuarantineKey.
//
// The quarantine queue is read with basic.get, one message at a time and
// only when it can run at once: while no origin message is in flight. So
// the client never holds a quarantine message it has not started: a crash
// while one runs is that message's own, and a graceful stop never returns
// (and so never charges a redelivery to) a quarantine message that waited.
// A consumer with prefetch 1 would hold one in its buffer behind the origin
// message in flight, and a stop or a neighbour's crash then returned it
// with the redelivered flag: counted as its own crash.
type quarantineSubscriber struct {
	origin    *wamqp.Subscriber
	conn      wamqp.ConnectionConfig
	marshaler wamqp.Marshaler
	topo      *Topology
	queueName func(topic string) string
	// handBack publishes msg (unchanged: same attempt and redelivery count)
	// to queue's quarantine queue and returns once the broker confirmed it.
	handBack func(ctx context.Context, msg *message.Message, queue string) error
	logger   watermill.LoggerAdapter
	poll     time.Duration

	done    chan struct{} // closed by Close
	mu      sync.Mutex
	closed  bool
	release []func()
	wg      sync.WaitGroup // the subscriptions' goroutines
}

func newQuarantineSubscriber(cfg wamqp.Config, topo *Topology, handBack func(context.Context, *message.Message, string) error,
	logger watermill.LoggerAdapter) (*quarantineSubscriber, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	origin, err := wamqp.NewSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	conn := cfg.Connection
	if a := conn.AmqpConfig; a != nil {
		ac := *a
		ac.Properties = maps.Clone(a.Properties)
		if name, ok := ac.Properties["connection_name"].(string); ok && name != "" {
			ac.Properties["connection_name"] = name + ".quarantine"
		}
		conn.AmqpConfig = &ac
	}
	return &quarantineSubscriber{origin: origin, conn: conn, marshaler: cfg.Marshaler, topo: topo, queueName: cfg.Queue.GenerateName,
		handBack: handBack, logger: logger, poll: quarantinePollInterval, done: make(chan struct{})}, nil
}

// Subscribe consumes topic's originating queue and its quarantine.
func (s *quarantineSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.origin.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	queue := s.queueName(topic)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("amqpretry: subscriber closed")
	}
	var once sync.Once
	wake := s.topo.quarantines.add(queue)
	s.release = append(s.release, func() { once.Do(func() { s.topo.quarantines.remove(queue, wake) }) })
	s.wg.Add(1)
	s.mu.Unlock()

	out := make(chan *message.Message)
	var wg sync.WaitGroup
	// gate: a quarantine message runs alone in this subscription; an origin
	// message waits for it, and it is fetched only once the origin message
	// in flight is settled and its ack written. So a crash while it runs is
	// its own, and the ack of an origin delivery the guard just moved into
	// the quarantine is on the wire before the copy is fetched.
	var gate sync.RWMutex
	wg.Add(2)
	go func() {
		defer wg.Done()
		for msg := range in {
			// watermill-amqp cancels the context it gave the message once it
			// has written the ack or nack to the broker (its processMessage
			// returned): waiting for it, not just for the router's ack,
			// closes the window in which a crash could lose the ack.
			settled := msg.Context().Done()
			gate.RLock()
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
			gate.RUnlock()
		}
	}()
	go func() {
		defer wg.Done()
		s.consumeQuarantine(ctx, queue, wake, &gate, out)
	}()
	go func() {
		defer s.wg.Done()
		wg.Wait()
		close(out)
	}()
	return out, nil
}

// stopped reports whether the subscription must stop: Close, or ctx ended.
func (s *quarantineSubscriber) stopped(ctx context.Context) bool {
	select {
	case <-s.done:
		return true
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

// consumeQuarantine fetches queue's quarantine messages one by one (see
// quarantineSubscriber) until ctx ends or the subscriber closes: at once
// when woken (this process moved a message there), else every s.poll.
func (s *quarantineSubscriber) consumeQuarantine(ctx context.Context, queue string, wake <-chan struct{}, gate *sync.RWMutex, out chan<- *message.Message) {
	qq := s.topo.naming.QuarantineQueue(queue)
	fields := watermill.LogFields{"queue": queue, "quarantine_queue": qq}
	var (
		conn *amqp.Connection
		ch   *amqp.Channel
	)
	reset := func() {
		if conn != nil {
			_ = conn.Close()
		}
		conn, ch = nil, nil
	}
	defer reset()
	tick := time.NewTicker(s.poll)
	defer tick.Stop()
	for {
		for !s.stopped(ctx) {
			if ch == nil {
				var err error
				if conn, err = s.dial(); err == nil {
					if ch, err = conn.Channel(); err != nil {
						reset()
					}
				}
				if err != nil {
					s.logger.Error("Cannot connect to consume the quarantine queue; retrying", redact.Error(err, s.conn.AmqpURI), fields)
					break
				}
			}
			// Ready count first: no gate taken while the quarantine is empty.
			st, err := ch.QueueDeclarePassive(qq, true, false, false, false, nil)
			if err != nil {
				s.logger.Error("Cannot inspect the quarantine queue; retrying", redact.Error(err, s.conn.AmqpURI), fields)
				reset()
				break
			}
			if st.Messages == 0 {
				break
			}
			gate.Lock()
			more, err := s.runOne(ctx, ch, queue, qq, out)
			gate.Unlock()
			if err != nil {
				s.logger.Error("Quarantine delivery failed; reconnecting", redact.Error(err, s.conn.AmqpURI), fields)
				reset()
				break
			}
			if !more {
				break
			}
		}
		select {
		case <-s.done:
			return
		case <-ctx.Done():
			return
		case <-wake:
		case <-tick.C:
		}
	}
}

// runOne fetches one message from the quarantine queue qq (basic.get), hands
// it out and settles it: the router's ack acks it; a nack, or a stop before
// the router took it, hands it back (a confirmed copy with the same attempt
// and redelivery count, then an ack of the delivery), so that returning it
// unprocessed is not a redelivery. Only when the copy cannot be published
// is the delivery requeued (then counted as a redelivery). It reports
// whether a message was fetched; an error means the channel is unusable.
func (s *quarantineSubscriber) runOne(ctx context.Context, ch *amqp.Channel, queue, qq string, out chan<- *message.Message) (bool, error) {
	if s.stopped(ctx) {
		return false, nil
	}
	d, ok, err := ch.Get(qq, false)
	if err != nil || !ok {
		return false, err
	}
	msg, err := s.marshaler.Unmarshal(d)
	if err != nil {
		s.logger.Error("Cannot unmarshal a quarantine delivery; requeueing it", err, watermill.LogFields{"queue": queue})
		return false, d.Nack(false, true)
	}
	msg.Metadata.Set(retrymeta.DeliveryQuarantineKey, "true")
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msg.SetContext(mctx)
	select {
	case out <- msg:
	case <-s.done:
		return true, s.giveBack(ch, d, msg, queue)
	case <-ctx.Done():
		return true, s.giveBack(ch, d, msg, queue)
	}
	var stop <-chan struct{} = s.done
	for {
		select {
		case <-msg.Acked():
			return true, d.Ack(false)
		case <-msg.Nacked():
			return true, s.giveBack(ch, d, msg, queue)
		case <-stop:
			// Closed with the handler still running (past the drain
			// timeout): the router's verdict, if it comes now, wins; else
			// it goes back to the broker as watermill-amqp would return it.
			select {
			case <-msg.Acked():
				return true, d.Ack(false)
			case <-msg.Nacked():
				return true, s.giveBack(ch, d, msg, queue)
			default:
			}
			s.logger.Info("Quarantine message still running at close; requeueing it", watermill.LogFields{"queue": queue, "message_uuid": msg.UUID})
			return true, d.Nack(false, true)
		}
	}
}

// giveBack returns a quarantine delivery that was not settled as an
// uncounted copy (see runOne).
//
// A delivery whose channel closed (connection lost) is already back in the
// queue: no copy then, which would duplicate it.
func (s *quarantineSubscriber) giveBack(ch *amqp.Channel, d amqp.Delivery, msg *message.Message, queue string) error {
	if ch.IsClosed() {
		return amqp.ErrClosed
	}
	if err := s.handBack(context.Background(), msg, queue); err != nil {
		s.logger.Error("Cannot hand a quarantine message back as a copy; requeueing it (its redelivery will count)", err,
			watermill.LogFields{"queue": queue, "message_uuid": msg.UUID})
		return d.Nack(false, true)
	}
	return d.Ack(false)
}

// dial connects like watermill-amqp does with the subscriber's connection
// settings (connection_name, if set, with ".quarantine" appended).
func (s *quarantineSubscriber) dial() (*amqp.Connection, error) {
	switch {
	case s.conn.AmqpConfig != nil:
		return amqp.DialConfig(s.conn.AmqpURI, *s.conn.AmqpConfig)
	case s.conn.TLSConfig != nil:
		return amqp.DialTLS(s.conn.AmqpURI, s.conn.TLSConfig)
	default:
		return amqp.Dial(s.conn.AmqpURI)
	}
}

// SubscribeInitialize declares the originating queue's topology (the
// quarantine queue included).
// SettledContexts tells router.DrainingSubscriber that, like
// watermill-amqp's subscriber it wraps, it ends each message's context
// once the message's ack or nack is sent (runOne's cancel).
func (s *quarantineSubscriber) SettledContexts() {}

func (s *quarantineSubscriber) SubscribeInitialize(topic string) error {
	return s.origin.SubscribeInitialize(topic)
}

// Close stops fetching from the quarantines (a message fetched and not yet
// settled is handed back, see runOne), waits for that, then closes the
// origin subscriber; the quarantine no longer counts as consumed by this
// process.
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
	err := s.origin.Close()
	s.wg.Wait()
	return err
}
