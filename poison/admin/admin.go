package admin

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
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
	pub    *amqpretry.ConfirmPublisher

	mu     sync.Mutex
	closed bool
}

// New applies defaults to cfg, validates it and connects to the broker
// (one connection, dial timeout 10s, connection name
// "rabbitretry-poison-admin"). It returns the Validate error for a bad
// config, or an error wrapping the dial error when the broker is
// unreachable or refuses the credentials; it does not retry.
func New(cfg Config) (*Admin, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	uri := cfg.URI
	pub, err := amqpretry.NewConfirmPublisher(amqpretry.PublisherConfig{
		Dial: func() (*amqp.Connection, error) {
			props := amqp.NewConnectionProperties()
			props.SetClientConnectionName(connectionName)
			return amqp.DialConfig(uri, amqp.Config{Dial: amqp.DefaultDial(dialTimeout), Properties: props})
		},
		Channels: 1,
		Logger:   cfg.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("poison/admin: connecting to the broker at %s: %w", RedactURI(uri), err)
	}
	return &Admin{cfg: cfg, logger: cfg.Logger, pub: pub}, nil
}

// RedactURI returns uri with its password replaced by "xxxxx", for
// messages and logs; "<invalid AMQP URI>" if it does not parse.
func RedactURI(uri string) string {
	u, err := amqp.ParseURI(uri)
	if err != nil {
		return "<invalid AMQP URI>"
	}
	if u.Password != "" {
		u.Password = "xxxxx"
	}
	return u.String()
}

// Close closes the connection, waiting (at most the publisher confirm
// timeout, 30s) for publishes still awaiting their confirm. Messages read
// by operations still running return to their queue. Close is idempotent;
// every method called afterwards returns ErrClosed.
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
		return ErrClosed
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
		if errors.Is(err, amqpretry.ErrClosed) {
			return nil, ErrClosed
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

// classify turns a passive-declare error into a *NotFoundError (404) or a
// descriptive error.
func classify(kind, name string, err error) error {
	var aerr *amqp.Error
	if errors.As(err, &aerr) {
		switch aerr.Code {
		case amqp.NotFound:
			return &NotFoundError{Kind: kind, Name: name, Err: err}
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
	depth     int // ready messages at the start (passive declare)
	consumers int // consumers at the start
	scanned   int // messages fetched
	lastTag   uint64
	matched   []item
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
	if err := f.Validate(); err != nil {
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
		m := MessageFromDelivery(d)
		if visit != nil {
			visit(m)
			continue
		}
		if f.Match(m) {
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
// delivery-tag=0 multiple=true requeue=true) and closes the channel. The close handshake
// completes after the broker processed every ack and nack sent before it,
// so a nil error means all acks took effect; an error means some may not
// have (the broker closed the channel or the connection dropped).
func (s *scan) release() error {
	var nackErr error
	if s.lastTag > 0 {
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
// the delivery limit (default 20): give poison queues a policy with
// delivery-limit -1 there ("Quorum Queues"). Only messages that were ready
// when List started are examined (passive queue.declare message count,
// "Queues").
//
// Errors: a *NotFoundError matching ErrQueueNotFound if queue does not
// exist; a Filter.Validate error; ErrClosed; ctx.Err() (wrapped) if ctx ends
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
