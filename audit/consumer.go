package audit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// ConsumerStats are the Consumer's counters.
type ConsumerStats struct {
	// Arrivals and Attempts are the records written (Write returned nil;
	// a redelivered record written again counts again; a redelivered
	// arrival found stored through the delivery log is not written and not
	// counted).
	Arrivals, Attempts uint64
	// Batches is the number of successful Store.Write calls.
	Batches uint64
	// WriteFailures counts failed Store.Write and SetAside calls
	// (temporary ones are retried; a batch rejected for good is split).
	WriteFailures uint64
	// Malformed counts attempt records that could not be decoded (logged
	// and acked).
	Malformed uint64
	// Untrusted counts attempt records refused because their user-id is
	// absent or not one of ConsumerConfig.RecorderUsers (logged and acked,
	// not stored).
	Untrusted uint64
	// Reconnects counts sessions that ended with a lost connection or
	// channel.
	Reconnects uint64
	// SetAside counts records the Store rejected for good
	// (ErrRecordRejected) and kept apart with the reason (SetAsider).
	SetAside uint64
	// Undecodable counts connections the AMQP client closed because a
	// delivery could not be decoded (amqp091-go refuses header tables
	// nested deeper than 32 or with more than 8192 entries: SYNTAX_ERROR).
	// RabbitMQ redelivers such a message on every connection: the next
	// session consumes one message at a time (prefetch 1), so only the bad
	// message is counted towards the queue's delivery limit, which
	// dead-letters it to the set-aside queue (after 1000 deliveries). A growing
	// count is that loop.
	Undecodable uint64
	// LastWriteLatency is how long the last successful Store.Write took.
	LastWriteLatency time.Duration
	// Lag is the audit's lag: at the commit of the last batch holding
	// attempt records, how long ago the newest of them ended (its StartedAt
	// + Duration, by the Recorder's clock). It grows while records wait in
	// the attempts queue (PostgreSQL down or slow, no Consumer running);
	// it is not updated while no attempt records arrive.
	Lag time.Duration
}

// Consumer moves audit records from RabbitMQ into a Store: arrivals (one
// copy of each message published to the audited business exchanges, via
// the arrivals queue) and attempt records (published by the Recorder to
// the attempts queue).
//
// Delivery guarantee: records are acked only after Store.Write returned nil
// (the transaction committed), per channel with one ack with multiple=true
// of the batch's highest delivery tag ("Consumer Acknowledgements and
// Publisher Confirms"). Up to Writers batches are written at once and may
// commit in any order; they are acked in the order they were filled, so a
// multiple ack never covers a batch that has not committed. While Write fails (PostgreSQL down) the batch stays
// unacked and is retried with backoff; the queues hold everything behind
// it durably. If the connection is lost or the process dies, the broker
// requeues the unacked deliveries and they are written again: Store.Write
// is idempotent on the record IDs, so nothing is lost, and a redelivered
// attempt record is not duplicated. An arrival redelivered after a lost
// connection keeps its per-publish ID (Arrival.ID) and is not duplicated.
// After the Consumer process died between commit and ack, RabbitMQ gives
// the redelivery no identity that says whether it was stored: with a Store
// with a delivery log (pgstore), each committed delivery has a row until
// its ack, and a redelivery claims a row of a session that ended (below)
// instead of being stored again, so each publish is exactly one arrival
// (a second, flagged record only if the process died in the instant
// between marking a batch's rows and sending its ack);
// with another Store it is stored a second time, flagged
// Arrival.MaybeDuplicate.
//
// Session queues (delivery log only): each session (AMQP connection)
// declares an exclusive, auto-delete classic queue named
// <ArrivalsQueue>.session.<random token>, which receives nothing. RabbitMQ
// deletes it when the connection closes, which is when the connection's
// unacked deliveries are requeued ("Queues" guide: Exclusive Queues;
// "Consumer Acknowledgements and Publisher Confirms"): a redelivery claims
// only rows of sessions whose queue is gone (queue.declare passive: 404;
// a live one answers 405 RESOURCE_LOCKED). The Consumer's user needs
// configure permission on these names ("Access Control"); a refusal makes
// Run return the error. Right before each ack of arrivals the Consumer
// marks the batch's rows Acking and deletes the rows it marked before
// (their acks were sent), one statement per batch (DeliveriesAcking); a
// session that ends with its connection open deletes its last marked
// rows; rows older than a day are pruned. An Acking row is never claimed:
// a redelivery matching only Acking rows of ended sessions (the process
// died between the mark and the ack, or right after the ack) deletes one
// and is stored under a new ID, flagged Arrival.MaybeDuplicate; a batch
// whose ack could not be sent has its mark cleared (DeliveriesNotAcked),
// and its rows are claimed as usual. So a publish is never
// taken for another and never lost; the cost is a flagged second record
// when the process dies in the instant between a mark and its ack. A
// redelivery matching only rows of live sessions (rechecked once after
// 1 s) is stored: those rows are other publishes of the same content.
//
// Once declared, the arrivals queue receives a copy of every publish to
// the audited exchanges whether or not a Consumer runs, and the attempts
// queue every record the Recorders publish: they grow (durably, on disk)
// while no Consumer runs or the store is down. No length limit is set, as
// one would drop records; watch their depth. Quorum audit queues carry a
// delivery limit of 1000 deliveries (each connection loss counts as a
// delivery of every record held) and dead-letter past it to the set-aside
// queue, never dropping a record.
//
// A record the Store rejects for good (ErrRecordRejected) does not stall
// the others: the batch is split until the record is alone, and it is set
// aside with the reason (SetAsider; Stats().SetAside). A delivery the AMQP
// client cannot decode closes the connection (Stats().Undecodable); the
// Consumer then takes one message at a time, so only that message reaches
// the delivery limit and is dead-lettered to the set-aside queue.
type Consumer struct {
	cfg   ConsumerConfig
	ids   *publishIDs // without a delivery log
	log   deliveryLog // cfg.Store's, if it has one
	ended sync.Map    // session tokens seen ended

	untrusted                                                    atomic.Uint64
	arrivals, attempts, batches, failures, malformed, reconnects atomic.Uint64
	setAside, undecodable                                        atomic.Uint64
	lastLatency, lag                                             atomic.Int64
}

// NewConsumer validates cfg (after filling in defaults) and returns a
// Consumer; nothing is connected until Declare or Run.
func NewConsumer(cfg ConsumerConfig) (*Consumer, error) {
	cfg.Exchanges = append([]Binding(nil), cfg.Exchanges...)
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Consumer{cfg: cfg, ids: newPublishIDs()}
	c.log = deliveryLogOf(cfg.Store)
	return c, nil
}

// Stats returns the counters.
func (c *Consumer) Stats() ConsumerStats {
	return ConsumerStats{
		Arrivals: c.arrivals.Load(), Attempts: c.attempts.Load(), Batches: c.batches.Load(),
		WriteFailures: c.failures.Load(), Malformed: c.malformed.Load(), Untrusted: c.untrusted.Load(), Reconnects: c.reconnects.Load(),
		SetAside: c.setAside.Load(), Undecodable: c.undecodable.Load(),
		LastWriteLatency: time.Duration(c.lastLatency.Load()), Lag: time.Duration(c.lag.Load()),
	}
}

func (c *Consumer) dial() (*amqp.Connection, error) {
	cfg := amqp.Config{Dial: amqp.DefaultDial(10 * time.Second), Heartbeat: 10 * time.Second}
	if c.cfg.AmqpConfig != nil {
		cfg = *c.cfg.AmqpConfig
	}
	props := amqp.NewConnectionProperties()
	for k, v := range cfg.Properties {
		props[k] = v
	}
	props.SetClientConnectionName(c.cfg.ConnectionName)
	cfg.Properties = props
	conn, err := amqp.DialConfig(c.cfg.URI, cfg)
	return conn, redact.Error(err, c.cfg.URI)
}

// ErrExchangeNotFound is returned (wrapped, naming the exchange) when an
// exchange does not exist on the broker: by Consumer.Declare and
// Consumer.Run for an audited business exchange, and by Resender.Resend
// for the loop-back exchange of a ResendToQueue (nothing was published).
var ErrExchangeNotFound = errors.New("audit: exchange not found")

// Declare connects, checks that every audited exchange exists
// (exchange.declare passive), declares the arrivals queue with its bindings
// and the attempts queue and audit exchange (declareAttemptTopology), then
// disconnects. Run does the same on each (re)connect; call Declare first
// when messages must be audited from the moment they are published. It
// returns ErrExchangeNotFound (wrapped, naming the exchange), the broker's 406 for a queue that
// exists with another type, or the connection error.
func (c *Consumer) Declare() error {
	conn, err := c.dial()
	if err != nil {
		return fmt.Errorf("audit: connecting: %w", err)
	}
	defer conn.Close()
	return c.declare(conn)
}

func (c *Consumer) declare(conn *amqp.Connection) error {
	for _, b := range c.cfg.Exchanges {
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		err = ch.ExchangeDeclarePassive(b.Exchange, amqp.ExchangeTopic, true, false, false, false, nil)
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.NotFound {
			return fmt.Errorf("%w: %q (declare it, or fix ConsumerConfig.Exchanges)", ErrExchangeNotFound, b.Exchange)
		} else if err != nil {
			return fmt.Errorf("audit: checking exchange %q: %w", b.Exchange, err)
		}
		_ = ch.Close()
	}
	legacy, err := declareAttempts(conn, c.cfg.Naming, c.cfg.QueueType)
	if err != nil {
		return err
	}
	old, err := declareQueue(conn, c.cfg.Naming.ArrivalsQueue, c.cfg.QueueType, c.cfg.Naming)
	if err != nil {
		return err
	}
	if old {
		legacy = append(legacy, c.cfg.Naming.ArrivalsQueue)
	}
	if len(legacy) > 0 {
		c.cfg.Logger.Error("Audit queues declared by an older version, without a delivery limit and dead-letter target: "+
			"on RabbitMQ 4.x records held during a store outage are dropped after 20 connection losses unless the upgrade policy "+
			"is set (README, Audit, upgrading the audit queues)", nil, watermill.LogFields{"queues": legacy})
	}
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	for _, b := range c.cfg.Exchanges {
		if err := ch.QueueBind(c.cfg.Naming.ArrivalsQueue, b.RoutingKey, b.Exchange, false, b.Args); err != nil {
			return fmt.Errorf("audit: binding %q to exchange %q with key %q: %w", c.cfg.Naming.ArrivalsQueue, b.Exchange, b.RoutingKey, err)
		}
	}
	return nil
}

// errFatal marks a session error that reconnecting cannot fix.
type errFatal struct{ error }

func (e errFatal) Unwrap() error { return e.error }

// errUndecodable marks a session the AMQP client ended because it could
// not decode a delivery.
type errUndecodable struct{ error }

func (e errUndecodable) Unwrap() error { return e.error }

// connClosed is the session's error for the connection's close reason:
// errUndecodable when the client itself closed it on a frame it could not
// decode (amqp091-go shuts the connection down with FRAME_ERROR wrapping
// ErrSyntax, ErrFrame or ErrFrameTooLarge).
func (c *Consumer) connClosed(e *amqp.Error) error {
	err := fmt.Errorf("audit: connection closed: %v", e)
	if e != nil && !e.Server {
		for _, bad := range []*amqp.Error{amqp.ErrSyntax, amqp.ErrFrame, amqp.ErrFrameTooLarge} {
			if strings.Contains(e.Reason, bad.Reason) {
				c.undecodable.Add(1)
				return errUndecodable{fmt.Errorf("audit: the AMQP client could not decode a delivery and closed the connection "+
					"(RabbitMQ redelivers it; it is set aside past the queue's delivery limit): %v", e)}
			}
		}
	}
	return err
}

// Run consumes until ctx ends, then returns nil (the unacked batches in
// flight are requeued by the broker). It reconnects with ReconnectBackoff
// after a lost connection or channel (the batches in memory, committed or
// not, are dropped unacked; the broker redelivers them). It returns at once, with the error, for what
// reconnecting cannot fix: a missing business exchange
// (ErrExchangeNotFound) or an audit queue that exists with other arguments.
func (c *Consumer) Run(ctx context.Context) error {
	var bo backoff.BackOff
	quarantine := false
	for {
		began := time.Now()
		err := c.session(ctx, &quarantine)
		if ctx.Err() != nil {
			return nil
		}
		var fatal errFatal
		if errors.As(err, &fatal) {
			return fatal.error
		}
		c.reconnects.Add(1)
		var undecodable errUndecodable
		if errors.As(err, &undecodable) {
			// One message at a time until it is set aside; reconnect
			// quickly (the broker is fine).
			quarantine = true
			bo = nil
		}
		if bo == nil || time.Since(began) > time.Minute {
			bo = c.cfg.ReconnectBackoff() // a session that lasted starts the backoff over
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			wait = 10 * time.Second
		}
		c.cfg.Logger.Error("Audit consumer session ended; reconnecting", err, watermill.LogFields{"retry_in": wait.String()})
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}
