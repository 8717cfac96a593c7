package admin

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/redact"
)

const (
	connectionName = "rabbitretry-poison-admin"
	dialTimeout    = 10 * time.Second
)

// Admin operates on poison queues of one broker vhost. Create it with New
// and release it with Close. See the package documentation for how queues
// are read and for concurrency.
type Admin struct {
	cfg    Config
	logger watermill.LoggerAdapter
	pub    *confirm.Publisher

	mu     sync.Mutex
	closed bool

	// hook, if set (tests only, see export_test.go), is called at the
	// steps of the modifying operations, with the number of matched
	// messages handled so far; a test pauses there to break the broker.
	hook func(step string, done int)
}

// at calls the test hook, if any.
func (a *Admin) at(step string, done int) {
	if a.hook != nil {
		a.hook(step, done)
	}
}

// New applies defaults to cfg, validates it and connects to the broker
// (one connection, dial timeout 10s, connection name Config.ConnectionName,
// default "rabbitretry-poison-admin"). It returns the Validate error for a bad
// config, or an error wrapping the dial error when the broker is
// unreachable or refuses the credentials; it does not retry.
func New(cfg Config) (*Admin, error) {
	name := cfg.ConnectionName
	if name == "" {
		name = connectionName
	}
	return newAdmin(cfg, name)
}

// newAdmin is New with the client-provided connection name.
func newAdmin(cfg Config, name string) (*Admin, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	uri := cfg.URI
	pub, err := confirm.New(confirm.Config{
		Dial: func() (*amqp.Connection, error) {
			props := amqp.NewConnectionProperties()
			props.SetClientConnectionName(name)
			conn, err := amqp.DialConfig(uri, amqp.Config{Dial: amqp.DefaultDial(dialTimeout), Properties: props})
			return conn, redact.Error(err, uri)
		},
		Channels: 1,
		Logger:   cfg.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("poison/admin: connecting to the broker at %s: %w", redact.URI(uri), err)
	}
	return &Admin{cfg: cfg, logger: cfg.Logger, pub: pub}, nil
}

// Close closes the connection, waiting (at most the publisher confirm
// timeout, 30s) for publishes still awaiting their confirm. Messages read
// by operations still running return to their queue. Close is idempotent;
// every method called afterwards returns middleware.ErrClosed (wrapped).
func (a *Admin) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	a.mu.Unlock()
	return a.pub.Close()
}

func (a *Admin) checkOpen() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return errClosed
	}
	return nil
}

// channel opens a fresh channel: a passive declare on a missing entity
// closes its channel with 404, so every operation gets its own.
func (a *Admin) channel() (*amqp.Channel, error) {
	if err := a.checkOpen(); err != nil {
		return nil, err
	}
	ch, err := a.pub.Channel()
	if err != nil {
		if errors.Is(err, confirm.ErrClosed) {
			return nil, errClosed
		}
		return nil, fmt.Errorf("poison/admin: opening a channel: %w", err)
	}
	return ch, nil
}

func checkName(kind, name string) error {
	if name == "" {
		return fmt.Errorf("poison/admin: %s name is empty", kind)
	}
	if len(name) > maxNameBytes {
		return fmt.Errorf("poison/admin: %s name %.60q... is %d bytes, more than RabbitMQ's %d", kind, name, len(name), maxNameBytes)
	}
	return nil
}

// classify turns a passive-declare error into a *notFoundError (404) or a
// descriptive error.
func classify(kind, name string, err error) error {
	var aerr *amqp.Error
	if errors.As(err, &aerr) {
		switch aerr.Code {
		case amqp.NotFound:
			return &notFoundError{Kind: kind, Name: name, Err: err}
		case amqp.ResourceLocked:
			return fmt.Errorf("poison/admin: %s %q is exclusive to another connection: %w", kind, name, err)
		case amqp.AccessRefused:
			return fmt.Errorf("poison/admin: access to %s %q refused (check the user's permissions): %w", kind, name, err)
		}
	}
	return fmt.Errorf("poison/admin: checking %s %q: %w", kind, name, err)
}

// inspectQueue returns the queue's state from a passive queue.declare on a
// fresh channel that it closes.
func (a *Admin) inspectQueue(queue string) (amqp.Queue, error) {
	if err := checkName("queue", queue); err != nil {
		return amqp.Queue{}, err
	}
	ch, err := a.channel()
	if err != nil {
		return amqp.Queue{}, err
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		return amqp.Queue{}, classify("queue", queue, err)
	}
	return q, nil
}

// checkExchange verifies that exchange exists (passive exchange.declare on
// a fresh channel; the type argument is not checked by RabbitMQ for a
// passive declare).
func (a *Admin) checkExchange(exchange string) error {
	ch, err := a.channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.ExchangeDeclarePassive(exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		return classify("exchange", exchange, err)
	}
	return nil
}

// item is a matching message still held unacknowledged.
type item struct {
	msg Message
	d   amqp.Delivery
}

// scan is one read of a queue: every message fetched is held
// unacknowledged on ch until release.
type scan struct {
	queue     string
	ch        *amqp.Channel
	closes    chan *amqp.Error // ch.NotifyClose
	closeErr  error            // why ch closed, once known
	depth     int              // ready messages at the start (passive declare)
	consumers int              // consumers at the start
	scanned   int              // messages fetched
	lastTag   uint64
	acked     bool // remove sent an ack
	matched   []item
}

// alive returns nil while the scan channel is open, and otherwise an error
// wrapping the reason the broker or the connection gave (or
// amqp.ErrClosed). Once it is closed the messages it held are back in the
// queue (the broker requeues a closed channel's unacknowledged deliveries)
// and can no longer be removed through it, so a modifying operation must
// stop: anything it copied from then on would be a duplicate.
func (s *scan) alive() error {
	if s.closeErr != nil {
		return s.closeErr
	}
	if !s.ch.IsClosed() {
		return nil
	}
	// amqp091-go marks the channel closed before it hands out the reason;
	// keep asking until it did.
	select {
	case e, ok := <-s.closes:
		var reason error = amqp.ErrClosed
		if ok && e != nil {
			reason = e
		}
		s.closeErr = fmt.Errorf("the channel reading queue %q closed: %w", s.queue, reason)
		return s.closeErr
	default:
		return fmt.Errorf("the channel reading queue %q closed: %w", s.queue, amqp.ErrClosed)
	}
}

// errAckNotSent wraps the error of an ack that was never written (the
// channel was already known to be closed): the message is certainly still
// in the queue.
var errAckNotSent = errors.New("ack not sent")

// remove acks it and then waits until the broker processed the ack: AMQP
// 0-9-1 does not confirm acks, but a channel's methods are processed in
// order, so the reply to a synchronous method sent after the ack (a no-op
// basic.qos, prefetch unchanged at 0 = unlimited; basic.get ignores it)
// proves that the broker handled the ack, and an error on it means the
// channel died with the ack's outcome unknown. Without this barrier an ack
// written to a connection the broker already closed is silently dropped
// while the caller counts the message as removed.
//
// nil: the message is removed. An error wrapping errAckNotSent: it is
// still in the queue. Any other error: it may or may not have been removed.
// The test hook runs at "acked", between the ack and the barrier.
func (s *scan) remove(a *Admin, it item, done int) error {
	if err := s.alive(); err != nil {
		return fmt.Errorf("%w: %w", errAckNotSent, err)
	}
	if err := s.ch.Ack(it.d.DeliveryTag, false); err != nil {
		if errors.Is(err, amqp.ErrClosed) {
			return fmt.Errorf("%w: %w", errAckNotSent, s.reason(err))
		}
		return s.reason(err)
	}
	s.acked = true
	a.at("acked", done)
	if err := s.ch.Qos(0, 0, false); err != nil {
		return s.reason(err)
	}
	return nil
}

// reason returns the channel's close reason if it is closed, else err.
func (s *scan) reason(err error) error {
	if cerr := s.alive(); cerr != nil {
		return cerr
	}
	return err
}

// scanQueue reads at most the queue's initial depth of messages with
// basic.get noAck=false on a fresh channel, keeping those f matches (up to
// f.Limit); if visit is non-nil, it is called for every message read
// instead, and nothing is kept. The
// caller must call release, also on error paths after a non-nil scan was
// returned. On error nothing is kept: all read messages are requeued.
func (a *Admin) scanQueue(ctx context.Context, queue string, f Filter, visit func(Message)) (*scan, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if err := f.validate(); err != nil {
		return nil, err
	}
	if err := checkName("queue", queue); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ch, err := a.channel()
	if err != nil {
		return nil, err
	}
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		_ = ch.Close()
		return nil, classify("queue", queue, err)
	}
	s := &scan{queue: queue, ch: ch, depth: q.Messages, consumers: q.Consumers}
	s.closes = ch.NotifyClose(make(chan *amqp.Error, 1))
	for s.scanned < s.depth {
		if f.Limit > 0 && len(s.matched) >= f.Limit {
			break
		}
		if err := ctx.Err(); err != nil {
			_ = s.release()
			return nil, fmt.Errorf("poison/admin: reading queue %q interrupted after %d of %d messages: %w", queue, s.scanned, s.depth, err)
		}
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			_ = s.release()
			if errors.Is(err, amqp.ErrClosed) {
				return nil, fmt.Errorf("poison/admin: reading queue %q: channel or connection closed: %w", queue, err)
			}
			return nil, classify("queue", queue, err)
		}
		if !ok {
			break // drained faster than expected (another consumer)
		}
		s.scanned++
		s.lastTag = d.DeliveryTag
		m := messageFromDelivery(d)
		if visit != nil {
			visit(m)
			continue
		}
		if f.match(m) {
			s.matched = append(s.matched, item{msg: m, d: d})
		}
	}
	return s, nil
}

// finish releases s (see release) and then, if messages were handed back,
// waits until the broker shows them ready again: requeueing happens
// asynchronously after the channel closed (a few milliseconds on quorum
// queues, which apply returns through Raft), and without the wait an
// operation right after this one could miss them. It polls the queue depth
// (passive queue.declare) until it is at least the initial depth minus the
// removed messages, for at most requeueWait; consumers draining the queue
// concurrently only make it wait that long. The error is release's.
func (a *Admin) finish(s *scan, removed int) error {
	err := s.release()
	if s.scanned-removed <= 0 {
		return err
	}
	want := s.depth - removed
	ch, cerr := a.channel()
	if cerr != nil {
		return err
	}
	defer ch.Close()
	deadline := time.Now().Add(requeueWait)
	pause := time.Millisecond
	for {
		q, qerr := ch.QueueDeclarePassive(s.queue, false, false, false, false, nil)
		if qerr != nil || q.Messages >= want || time.Now().After(deadline) {
			return err
		}
		time.Sleep(pause)
		pause = min(2*pause, 50*time.Millisecond)
	}
}

// requeueWait bounds finish's wait for requeued messages to reappear.
const requeueWait = 2 * time.Second

// release requeues every message of the scan not acked yet (basic.nack
// delivery-tag=0 multiple=true requeue=true) and closes the channel. An
// error means the channel was already closed (or closed meanwhile); the
// broker then requeued the messages itself. Either way the acks confirmed
// by remove stand.
func (s *scan) release() error {
	var nackErr error
	if s.lastTag > 0 && !s.ch.IsClosed() {
		if s.acked {
			// The broker applies an ack on the queue's side after the
			// channel has taken it (remove's qos round trip only proves
			// the latter): when the queue lives on another cluster node,
			// or is a quorum queue, news of the channel's close can reach
			// the queue first, and it then requeues a message whose ack
			// is still on its way (seen on the 3-node cluster: a moved
			// message left in the poison queue as well). A basic.get
			// travels the same way as the acks and is answered only after
			// they were applied; what it fetches is requeued below.
			_, _, _ = s.ch.Get(s.queue, false)
		}
		// Delivery tag 0 with multiple=true means "all outstanding
		// deliveries" (AMQP 0-9-1 basic.nack); a concrete tag that was
		// already acked would be an unknown delivery tag (406).
		nackErr = s.ch.Nack(0, true, true)
	}
	closeErr := s.ch.Close()
	if nackErr != nil {
		return nackErr
	}
	return closeErr
}

// List returns the messages of queue that f matches, in queue order, at
// most f.Limit of them (0: all), and leaves every message in the queue: they
// are read with basic.get (noAck=false) and requeued afterwards with
// basic.nack requeue=true ("Consumer Acknowledgements and Publisher
// Confirms"). They come back with the redelivered flag, and on quorum queues
// with x-delivery-count incremented, which on RabbitMQ 4.0+ counts toward
// the delivery limit (default 20) on 4.0-4.2 (4.3 counts rejects, not
// nacks): give poison queues a policy with a large finite delivery-limit
// there, e.g. 1000000, not -1 (see the package doc, "Quorum Queues").
// Only messages that were ready
// when List started are examined (passive queue.declare message count,
// "Queues").
//
// Errors: a *notFoundError matching ErrQueueNotFound if queue does not
// exist; an invalid Filter (negative Limit, Since after Until); ErrClosed; ctx.Err() (wrapped) if ctx ends
// during the scan; channel or connection errors.
func (a *Admin) List(ctx context.Context, queue string, f Filter) ([]Message, error) {
	s, err := a.scanQueue(ctx, queue, f, nil)
	if err != nil {
		return nil, err
	}
	msgs := make([]Message, len(s.matched))
	for i, it := range s.matched {
		msgs[i] = it.msg
	}
	if err := a.finish(s, 0); err != nil {
		a.logger.Debug("Releasing listed messages failed; the broker requeues them when the channel closes", watermill.LogFields{
			"queue": queue, "error": err.Error(),
		})
	}
	return msgs, nil
}

// Stats summarises a queue.
type Stats struct {
	// Queue is the queue name.
	Queue string `json:"queue"`
	// Depth is the number of ready messages the broker reported at the start
	// (passive queue.declare; messages unacknowledged by consumers are not
	// included).
	Depth int `json:"depth"`
	// Consumers is the number of consumers the broker reported.
	Consumers int `json:"consumers"`
	// Scanned is how many messages were read (at most Depth).
	Scanned int `json:"scanned"`
	// ByClass, ByHandler and ByOriginalQueue count the scanned messages by
	// Message.Class, Message.Handler and Message.OriginalQueue; messages
	// without the header are counted under "".
	ByClass         map[string]int `json:"by_class"`
	ByHandler       map[string]int `json:"by_handler"`
	ByOriginalQueue map[string]int `json:"by_original_queue"`
	// Oldest and Newest are the earliest and latest Message.PoisonedAt among
	// the scanned messages; zero if none has one.
	Oldest time.Time `json:"oldest,omitzero"`
	Newest time.Time `json:"newest,omitzero"`
}

// Stats reads queue like List (every message is requeued) and returns its
// summary. Errors are those of List.
func (a *Admin) Stats(ctx context.Context, queue string) (Stats, error) {
	st := Stats{
		Queue:           queue,
		ByClass:         map[string]int{},
		ByHandler:       map[string]int{},
		ByOriginalQueue: map[string]int{},
	}
	s, err := a.scanQueue(ctx, queue, Filter{}, func(m Message) {
		st.ByClass[m.Class]++
		st.ByHandler[m.Handler]++
		st.ByOriginalQueue[m.OriginalQueue]++
		if !m.PoisonedAt.IsZero() {
			if st.Oldest.IsZero() || m.PoisonedAt.Before(st.Oldest) {
				st.Oldest = m.PoisonedAt
			}
			if st.Newest.IsZero() || m.PoisonedAt.After(st.Newest) {
				st.Newest = m.PoisonedAt
			}
		}
	})
	if err != nil {
		return Stats{}, err
	}
	st.Depth = s.depth
	st.Consumers = s.consumers
	st.Scanned = s.scanned
	_ = a.finish(s, 0)
	return st, nil
}
