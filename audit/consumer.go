package audit

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// Consumer defaults.
const (
	// DefaultBatchSize is the default number of records per Store.Write.
	DefaultBatchSize = 500
	// DefaultWriters is the default number of Store.Write calls in flight.
	DefaultWriters = 4
	// DefaultBatchWait is the default longest wait for a batch to fill.
	DefaultBatchWait = 200 * time.Millisecond
	// DefaultBodyLimit is the default number of body bytes kept per arrival.
	DefaultBodyLimit = 256 << 10
	// DefaultUUIDHeader is watermill-amqp's header of the message UUID.
	DefaultUUIDHeader = "_watermill_message_uuid"
)

// Binding is one audited business exchange.
type Binding struct {
	// Exchange is the business exchange; it must exist (the Consumer checks
	// it passively and never declares it). Required.
	Exchange string
	// RoutingKey binds the arrivals queue. Default "#": every message of a
	// topic exchange (a fanout exchange ignores it; for a direct exchange
	// name the key, and add one Binding per key).
	RoutingKey string
	// Args are the binding arguments (a headers exchange's x-match etc.).
	Args amqp.Table
}

// ConsumerConfig configures a Consumer. Zero values take the defaults
// documented per field.
type ConsumerConfig struct {
	// URI is the AMQP URI of the broker. Required.
	URI string
	// Store receives the records. Required.
	Store Store
	// Exchanges are the audited business exchanges: the arrivals queue is
	// bound to each. May be empty (then only attempt records are consumed).
	Exchanges []Binding
	// BatchSize is the most records per Store.Write. Default 500; the
	// prefetch (basic.qos) of each of the two channels is
	// (Writers+1)×BatchSize: Writers batches being written plus one
	// filling. Must be 1..32000, and (Writers+1)×BatchSize at most 65535
	// (basic.qos takes a 16-bit prefetch count).
	BatchSize int
	// Writers is how many batches are written concurrently (Store.Write
	// calls in flight, each in its own transaction; the Store must allow
	// concurrent Writes, as pgstore does). Default 4; must be >= 1.
	// Deliveries are still acked in batch order: a batch that committed is
	// acked only after every earlier batch was acked, so an ack with
	// multiple=true never covers a delivery whose batch has not committed
	// ("Consumer Acknowledgements and Publisher Confirms"). With Writers 1
	// the batches are written one at a time while the next fills.
	Writers int
	// BatchWait is how long a batch may wait to fill before it is written.
	// Default 200 ms.
	BatchWait time.Duration
	// BodyLimit is how many body bytes an Arrival keeps (Body is cut,
	// BodySize and BodyTruncated say so). Default 256 KiB; must be >= 0
	// (negative: keep no body).
	BodyLimit int
	// QueueType of the audit queues: QueueTypeQuorum (default) or
	// QueueTypeClassic.
	QueueType string
	// Naming names the audit exchange and queues; the Recorder must use the
	// same. Default Default*.
	Naming Naming
	// UUIDHeader is the header holding the Watermill message UUID (the
	// Marshaler's). Default DefaultUUIDHeader; without it, the AMQP
	// message-id property is the message id.
	UUIDHeader string
	// WriteBackoff paces retries of a failed Store.Write (PostgreSQL down):
	// the batch stays unacked in RabbitMQ and is written again, forever
	// until Run's context ends. Default: exponential from 100 ms, factor 2,
	// capped at 30 s.
	WriteBackoff func() backoff.BackOff
	// ReconnectBackoff paces reconnecting after the connection or a channel
	// was lost. Default: exponential from 100 ms, factor 2, capped at 10 s.
	ReconnectBackoff func() backoff.BackOff
	// AmqpConfig, when set, is the amqp091-go configuration every
	// connection is dialled with (TLSClientConfig, Heartbeat, Dial, Vhost,
	// SASL, ...); it is copied, and its connection_name property set to
	// ConnectionName. Default: heartbeat 10 s, dial timeout 10 s.
	AmqpConfig *amqp.Config
	// ConnectionName is the client-provided connection name shown by
	// rabbitmqctl list_connections and the management UI ("Connections").
	// Default "rabbitretry-audit-consumer".
	ConnectionName string
	// RecorderUsers are the RabbitMQ users whose attempt records are
	// stored: a record's AMQP user-id property must be one of them. RabbitMQ
	// refuses a publish whose user-id is not the publishing connection's
	// user ("Validated User-ID", the "Publishers" guide), and the Recorder
	// sets it to its own (RecorderConfig.UserID), so a record that passes
	// was published by that user, not by anyone else allowed to write to
	// the audit exchange. Other records (user-id absent or another user)
	// are refused: logged, counted in ConsumerStats.Untrusted, acked and
	// not stored. Default: the user of URI (amqp.ParseURI; "guest" if the
	// URI names none), for recorders that connect with the same
	// credentials as the Consumer; set it when they connect as another user
	// or authenticate otherwise (SASL EXTERNAL: the certificate's user).
	RecorderUsers []string
	// AcceptRecordsWithoutUserID also stores attempt records that carry no
	// user-id (published by a Recorder of an earlier version, which did not
	// set it). Set it only while such records drain from the attempts queue
	// during an upgrade: anyone allowed to publish to the audit exchange can
	// publish those. Default false.
	AcceptRecordsWithoutUserID bool
	// Logger logs outages and malformed records. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func expBackoff(initial, maxInterval time.Duration) func() backoff.BackOff {
	return func() backoff.BackOff {
		b := backoff.NewExponentialBackOff()
		b.InitialInterval = initial
		b.MaxInterval = maxInterval
		b.MaxElapsedTime = 0
		b.Reset()
		return b
	}
}

func (c *ConsumerConfig) setDefaults() {
	c.Naming = c.Naming.WithDefaults()
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.Writers == 0 {
		c.Writers = DefaultWriters
	}
	if c.BatchWait == 0 {
		c.BatchWait = DefaultBatchWait
	}
	if c.BodyLimit == 0 {
		c.BodyLimit = DefaultBodyLimit
	}
	if c.QueueType == "" {
		c.QueueType = QueueTypeQuorum
	}
	if c.UUIDHeader == "" {
		c.UUIDHeader = DefaultUUIDHeader
	}
	if c.WriteBackoff == nil {
		c.WriteBackoff = expBackoff(100*time.Millisecond, 30*time.Second)
	}
	if c.ReconnectBackoff == nil {
		c.ReconnectBackoff = expBackoff(100*time.Millisecond, 10*time.Second)
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.ConnectionName == "" {
		c.ConnectionName = "rabbitretry-audit-consumer"
	}
	if len(c.RecorderUsers) == 0 {
		if u, err := amqp.ParseURI(c.URI); err == nil {
			c.RecorderUsers = []string{u.Username}
		}
	}
	for i := range c.Exchanges {
		if c.Exchanges[i].RoutingKey == "" {
			c.Exchanges[i].RoutingKey = "#"
		}
	}
}

// Validate reports the first bad field. NewConsumer calls it after filling
// in defaults.
func (c ConsumerConfig) Validate() error {
	if c.URI == "" {
		return errors.New("audit: ConsumerConfig.URI is empty")
	}
	if _, err := amqp.ParseURI(c.URI); err != nil {
		return fmt.Errorf("audit: ConsumerConfig.URI is invalid: %w", redact.Error(err, c.URI))
	}
	if c.Store == nil {
		return errors.New("audit: ConsumerConfig.Store is nil")
	}
	for i, b := range c.Exchanges {
		if b.Exchange == "" {
			return fmt.Errorf("audit: ConsumerConfig.Exchanges[%d].Exchange is empty (the default exchange cannot be bound)", i)
		}
	}
	if c.BatchSize < 1 || c.BatchSize > 32_000 {
		return fmt.Errorf("audit: ConsumerConfig.BatchSize %d is outside 1..32000", c.BatchSize)
	}
	if c.Writers < 1 || c.Writers > 64 {
		return fmt.Errorf("audit: ConsumerConfig.Writers %d is outside 1..64", c.Writers)
	}
	if (c.Writers+1)*c.BatchSize > 65_535 {
		return fmt.Errorf("audit: ConsumerConfig (Writers+1)×BatchSize = %d exceeds the prefetch limit 65535", (c.Writers+1)*c.BatchSize)
	}
	if c.BatchWait < 0 {
		return fmt.Errorf("audit: ConsumerConfig.BatchWait %v is negative", c.BatchWait)
	}
	for i, u := range c.RecorderUsers {
		if u == "" {
			return fmt.Errorf("audit: ConsumerConfig.RecorderUsers[%d] is empty", i)
		}
	}
	if err := checkQueueType("ConsumerConfig", c.QueueType); err != nil {
		return err
	}
	return c.Naming.validate("ConsumerConfig")
}

// ConsumerStats are the Consumer's counters.
type ConsumerStats struct {
	// Arrivals and Attempts are the records written (Write returned nil;
	// a redelivered record written again counts again; a redelivered
	// arrival found stored through the DeliveryLog is not written and not
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
	// dead-letters it to the set-aside queue (DeliveryLimit). A growing
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
// that is a DeliveryLog (pgstore), each committed delivery has a row until
// its ack, and a redelivery claims a row of a session that ended (below)
// instead of being stored again, so each publish is exactly one arrival
// (a second, flagged record only if the process died in the instant
// between marking a batch's rows and sending its ack);
// with another Store it is stored a second time, flagged
// Arrival.MaybeDuplicate.
//
// Session queues (DeliveryLog only): each session (AMQP connection)
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
// delivery limit of DeliveryLimit (each connection loss counts as a
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
	ids   *publishIDs // without a DeliveryLog
	log   DeliveryLog // cfg.Store, if it is one
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
	c.log, _ = cfg.Store.(DeliveryLog)
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

// ErrExchangeMissing is returned (wrapped, naming the exchange) by Declare
// and Run when an audited business exchange does not exist.
var ErrExchangeMissing = errors.New("audit: business exchange does not exist")

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

// Declare connects, checks that every audited exchange exists
// (exchange.declare passive), declares the arrivals queue with its bindings
// and the attempts queue and audit exchange (DeclareAttempts), then
// disconnects. Run does the same on each (re)connect; call Declare first
// when messages must be audited from the moment they are published. It
// returns ErrExchangeMissing (wrapped), the broker's 406 for a queue that
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
			return fmt.Errorf("%w: %q (declare it, or fix ConsumerConfig.Exchanges)", ErrExchangeMissing, b.Exchange)
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
// (ErrExchangeMissing) or an audit queue that exists with other arguments.
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

// batch is what one Store.Write carries, with the highest delivery tag of
// each channel it acks; committed is closed once Write returned nil.
type batch struct {
	arrivals []Arrival
	// With a DeliveryLog, per arrival: its fingerprint, whether it was
	// redelivered, resolved (its ID final), claimed (a row of an ended
	// session had it: stored already).
	fps                            []string
	redelivered, resolved, claimed []bool
	attempts                       []Attempt
	arrTag, attTag                 uint64
	records, pending               int // records; deliveries (incl. malformed)
	committed                      chan struct{}
}

// session consumes until an error. With *quarantine set it starts with
// prefetch 1 and batches of 1 (after a delivery could not be decoded: only
// that message is held when it closes the connection again) and goes back
// to the configured prefetch and batch size, clearing *quarantine, once
// (Writers+1)×BatchSize deliveries went through.
func (c *Consumer) session(ctx context.Context, quarantine *bool) (err error) {
	// Last, once the writers and the acker are done: what is still unacked
	// is redelivered (publishIDs).
	defer func() { c.ids.sessionEnded(time.Now()) }()
	conn, err := c.dial()
	if err != nil {
		return fmt.Errorf("audit: connecting: %w", err)
	}
	defer conn.Close()
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	defer func() {
		// A delivery the client cannot decode may close the connection
		// while the session is still being set up: any error then.
		var u errUndecodable
		if err != nil && !errors.As(err, &u) {
			select {
			case e := <-closed:
				if cerr := c.connClosed(e); errors.As(cerr, &u) {
					err = cerr
				}
			default:
			}
		}
	}()
	if err := c.declare(conn); err != nil {
		var ae *amqp.Error
		if errors.Is(err, ErrExchangeMissing) || (errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed) {
			return errFatal{err}
		}
		return err
	}
	token := randomToken()
	if c.log != nil {
		if err := c.holdSession(conn, token); err != nil {
			var ae *amqp.Error
			if errors.As(err, &ae) && ae.Code == amqp.AccessRefused {
				return errFatal{fmt.Errorf("audit: declaring the session queue %q (the user needs configure permission on it): %w", c.sessionQueue(token), err)}
			}
			return fmt.Errorf("audit: declaring the session queue: %w", err)
		}
	}
	open := func(queue string) (*amqp.Channel, <-chan amqp.Delivery, error) {
		ch, err := conn.Channel()
		if err != nil {
			return nil, nil, err
		}
		prefetch := (c.cfg.Writers + 1) * c.cfg.BatchSize
		if *quarantine {
			prefetch = 1
		}
		if err := ch.Qos(prefetch, 0, false); err != nil {
			return nil, nil, err
		}
		d, err := ch.Consume(queue, "", false, false, false, false, nil)
		if err != nil {
			return nil, nil, fmt.Errorf("audit: consuming %q: %w", queue, err)
		}
		return ch, d, nil
	}
	arrCh, arrD, err := open(c.cfg.Naming.ArrivalsQueue)
	if err != nil {
		return err
	}
	attCh, attD, err := open(c.cfg.Naming.AttemptsQueue)
	if err != nil {
		return err
	}
	c.cfg.Logger.Info("Audit consumer connected", watermill.LogFields{
		"arrivals_queue": c.cfg.Naming.ArrivalsQueue, "attempts_queue": c.cfg.Naming.AttemptsQueue, "one_at_a_time": *quarantine,
	})
	batchSize, quarantined := c.cfg.BatchSize, 0
	if *quarantine {
		batchSize = 1
	}
	// delivered counts a delivery; in quarantine, the last one ends it.
	delivered := func() error {
		if !*quarantine {
			return nil
		}
		if quarantined++; quarantined < (c.cfg.Writers+1)*c.cfg.BatchSize {
			return nil
		}
		for _, ch := range []*amqp.Channel{arrCh, attCh} {
			if err := ch.Qos((c.cfg.Writers+1)*c.cfg.BatchSize, 0, false); err != nil {
				return err
			}
		}
		*quarantine, batchSize = false, c.cfg.BatchSize
		c.cfg.Logger.Info("Audit consumer back to full prefetch after an undecodable delivery", nil)
		return nil
	}
	// lost is the session's error when a consumer's delivery channel
	// closed: the connection's close reason if it has one (amqp091-go
	// sends it before closing the channels).
	lost := func(what string) error {
		select {
		case e := <-closed:
			return c.connClosed(e)
		default:
			return errors.New("audit: " + what + " consumer cancelled or channel closed")
		}
	}

	// Writers goroutines write batches concurrently while the next one
	// fills (the prefetch of (Writers+1)×BatchSize per channel allows
	// it). Each batch goes to the acker too, in the order it was filled;
	// the acker waits for each one's commit in that order before acking
	// it, so a multiple ack never covers a delivery of an unwritten batch.
	batches := make(chan batch)
	toAck := make(chan batch, c.cfg.Writers+1)
	werr := make(chan error, 1)
	fail := func(err error) {
		select {
		case werr <- err:
		default: // the session is ending already
		}
	}
	wctx, wcancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range c.cfg.Writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range batches {
				if b.records > 0 {
					if err := c.store(wctx, conn, token, &b); err != nil {
						fail(err)
						return
					}
				}
				close(b.committed)
			}
		}()
	}
	// With a DeliveryLog, the acker marks a batch's rows Acking right
	// before its ack (deleting the rows it marked before: their acks were
	// sent); marked says the last marked rows' ack was sent, so a session
	// that ends with its connection open deletes them too.
	marked := false
	wg.Add(1)
	go func() {
		defer wg.Done()
		for b := range toAck {
			select {
			case <-b.committed:
			case <-wctx.Done():
				return
			}
			ids := c.ackingIDs(b)
			if ids != nil {
				marked = false
				if err := c.markAcking(wctx, conn, token, ids); err != nil {
					fail(err)
					return
				}
			}
			if arrAcked, err := c.ack(arrCh, attCh, b); err != nil {
				if ids != nil && !arrAcked { // not sent: its redeliveries may claim the rows
					c.storeCall("Clearing the acking mark of unacked-delivery rows", len(ids), func(ctx context.Context) error {
						return c.log.DeliveriesNotAcked(ctx, token, ids)
					})
				}
				fail(err)
				return
			}
			marked = marked || ids != nil
		}
	}()
	defer func() {
		wcancel()
		close(batches)
		close(toAck)
		wg.Wait()
		if marked && !conn.IsClosed() { // the acks were sent on an open connection
			c.storeCall("Deleting the unacked-delivery rows of acked arrivals", 0, func(ctx context.Context) error {
				return c.log.DeliveriesAcking(ctx, token, nil)
			})
		}
	}()

	var b batch
	var timer *time.Timer
	var timerC <-chan time.Time
	flush := func() error {
		if timer != nil {
			timer.Stop()
			timer, timerC = nil, nil
		}
		if b.pending == 0 {
			return nil
		}
		b.committed = make(chan struct{})
		for _, q := range []chan batch{toAck, batches} { // toAck first: the acker sees batches in fill order
			select {
			case q <- b:
			case err := <-werr:
				return err
			case err := <-closed:
				return c.connClosed(err)
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		b = batch{} // fresh slices: the writer and the Store own the old ones
		return nil
	}
	add := func() error {
		if b.pending == 1 && timer == nil {
			timer = time.NewTimer(c.cfg.BatchWait)
			timerC = timer.C
		}
		if err := delivered(); err != nil {
			return err
		}
		if b.records >= batchSize {
			return flush()
		}
		return nil
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-closed:
			return c.connClosed(err)
		case err := <-werr:
			return err
		case <-timerC:
			timer, timerC = nil, nil
			if err := flush(); err != nil {
				return err
			}
		case d, ok := <-arrD:
			if !ok {
				return lost("arrivals")
			}
			a := c.arrival(d)
			b.arrivals = append(b.arrivals, a)
			if c.log != nil {
				b.fps = append(b.fps, fingerprint(c.cfg.Naming.ArrivalsQueue, a.contentID))
				b.redelivered = append(b.redelivered, d.Redelivered)
				b.resolved = append(b.resolved, !d.Redelivered)
				b.claimed = append(b.claimed, false)
			}
			b.arrTag, b.records, b.pending = d.DeliveryTag, b.records+1, b.pending+1
			if err := add(); err != nil {
				return err
			}
		case d, ok := <-attD:
			if !ok {
				return lost("attempts")
			}
			a, err := UnmarshalAttempt(d.Body)
			if err == nil && (a.ID == "" || a.MessageID == "") {
				err = errors.New("record without id or message_id")
			}
			a.RecordedBy = d.UserId // broker-validated, never the body's
			b.attTag, b.pending = d.DeliveryTag, b.pending+1
			if err == nil && !c.trusted(d.UserId) {
				c.untrusted.Add(1)
				c.cfg.Logger.Error("Attempt record from an untrusted user; acking it, not stored", errUntrusted, watermill.LogFields{
					"message_id": d.MessageId, "user_id": d.UserId, "record_message_id": a.MessageID,
				})
			} else if err != nil {
				c.malformed.Add(1)
				c.cfg.Logger.Error("Malformed attempt record; acking it", err, watermill.LogFields{
					"message_id": d.MessageId, "body": truncate(string(d.Body), 200),
				})
			} else {
				b.attempts = append(b.attempts, a)
				b.records++
			}
			if err := add(); err != nil {
				return err
			}
		}
	}
}

// ack acks b's deliveries (one multiple ack per channel); called only
// once b and every batch filled before it committed and were acked.
// arrAcked: the arrivals' ack was sent (or b has none).
func (c *Consumer) ack(arrCh, attCh *amqp.Channel, b batch) (arrAcked bool, err error) {
	if b.arrTag > 0 {
		if err := arrCh.Ack(b.arrTag, true); err != nil {
			return false, fmt.Errorf("audit: acking arrivals: %w", err)
		}
		if c.log == nil {
			c.ids.acked(b.arrivals)
		}
	}
	if b.attTag > 0 {
		if err := attCh.Ack(b.attTag, true); err != nil {
			return true, fmt.Errorf("audit: acking attempt records: %w", err)
		}
	}
	return true, nil
}

// store writes the records, splitting a batch the Store rejects for good
// (ErrRecordRejected) in halves until the rejected records are alone, and
// setting those aside. It returns an error only if ctx ends or the
// connection is lost meanwhile (then the batch is dropped from memory and
// the broker redelivers it; writes are idempotent).
func (c *Consumer) store(ctx context.Context, conn *amqp.Connection, token string, b *batch) error {
	err := c.write(ctx, conn, token, b)
	if err == nil || !errors.Is(err, ErrRecordRejected) {
		return err
	}
	if len(b.arrivals)+len(b.attempts) == 1 {
		return c.setAsideRecord(ctx, conn, b.arrivals, b.attempts, err)
	}
	for _, part := range b.halves() {
		if err := c.store(ctx, conn, token, part); err != nil {
			return err
		}
	}
	return nil
}

// halves splits b's records in two parts (arrivals apart from attempts
// first) for store. The parts share b's slices, so what write and
// claimRedelivered record on a part (final arrival IDs, claims) is b's.
func (b *batch) halves() []*batch {
	part := func(from, to int, arrivals bool) *batch {
		p := &batch{}
		if arrivals {
			p.arrivals = b.arrivals[from:to]
			if b.fps != nil {
				p.fps, p.redelivered = b.fps[from:to], b.redelivered[from:to]
				p.resolved, p.claimed = b.resolved[from:to], b.claimed[from:to]
			}
		} else {
			p.attempts = b.attempts[from:to]
		}
		return p
	}
	na, nt := len(b.arrivals), len(b.attempts)
	switch {
	case na > 0 && nt > 0:
		return []*batch{part(0, na, true), part(0, nt, false)}
	case na > 1:
		return []*batch{part(0, na/2, true), part(na/2, na, true)}
	default:
		return []*batch{part(0, nt/2, false), part(nt/2, nt, false)}
	}
}

// setAsideRecord keeps the one record of arr or att, rejected with
// reason, in the Store's SetAside. Without a SetAsider it retries the
// write forever (the old behaviour: the queue stalls, loudly).
func (c *Consumer) setAsideRecord(ctx context.Context, conn *amqp.Connection, arr []Arrival, att []Attempt, reason error) error {
	sa, ok := c.cfg.Store.(SetAsider)
	var rec SetAside
	if len(arr) == 1 {
		rec = SetAside{Kind: KindArrival, RecordID: arr[0].ID, MessageID: arr[0].MessageID, Reason: reason.Error()}
		rec.Record, _ = json.Marshal(arr[0])
	} else {
		rec = SetAside{Kind: KindAttempt, RecordID: att[0].ID, MessageID: att[0].MessageID, Reason: reason.Error()}
		rec.Record, _ = json.Marshal(att[0])
	}
	if !ok {
		c.cfg.Logger.Error("Audit store rejected a record for good and cannot set it aside (no SetAsider); retrying it", reason,
			watermill.LogFields{"kind": rec.Kind, "record_id": truncate(rec.RecordID, 100)})
		return c.retry(ctx, conn, "write", func(ctx context.Context) error {
			err := c.cfg.Store.Write(ctx, arr, att)
			if errors.Is(err, ErrRecordRejected) {
				return fmt.Errorf("%v (rejected)", err) // retried, not split again
			}
			return err
		})
	}
	err := c.retry(ctx, conn, "set-aside", func(ctx context.Context) error { return sa.SetAside(ctx, []SetAside{rec}) })
	if err != nil {
		return err
	}
	c.setAside.Add(1)
	c.cfg.Logger.Error("Audit record set aside: the store rejects it for good", reason, watermill.LogFields{
		"kind": rec.Kind, "record_id": truncate(rec.RecordID, 100), "message_id": truncate(rec.MessageID, 100),
	})
	return nil
}

// write calls Store.Write until it returns nil or an ErrRecordRejected
// (returned at once); another error only if ctx ends or the connection is
// lost meanwhile.
//
// With a DeliveryLog, redelivered arrivals that a row of an ended session
// holds are claimed first (stored already: only their rows are written
// again), and every arrival's row is written in the same transaction.
func (c *Consumer) write(ctx context.Context, conn *amqp.Connection, token string, b *batch) error {
	start := time.Now()
	arr, att := b.arrivals, b.attempts
	err := c.retry(ctx, conn, "write", func(ctx context.Context) error {
		start = time.Now()
		arr = b.arrivals
		if c.log == nil {
			return c.cfg.Store.Write(ctx, arr, att)
		}
		if err := c.claimRedelivered(ctx, conn, token, b); err != nil {
			return err
		}
		arr = make([]Arrival, 0, len(b.arrivals))
		dels := make([]UnackedDelivery, len(b.arrivals))
		for i := range b.arrivals {
			if !b.claimed[i] {
				arr = append(arr, b.arrivals[i])
			}
			dels[i] = UnackedDelivery{ArrivalID: b.arrivals[i].ID, Fingerprint: b.fps[i], Session: token}
		}
		return c.log.WriteDeliveries(ctx, arr, att, dels)
	})
	if err != nil {
		return err
	}
	c.lastLatency.Store(int64(time.Since(start)))
	c.batches.Add(1)
	c.arrivals.Add(uint64(len(arr)))
	c.attempts.Add(uint64(len(att)))
	if len(att) > 0 {
		var newest time.Time
		for _, a := range att {
			if end := a.StartedAt.Add(a.Duration); end.After(newest) {
				newest = end
			}
		}
		c.lag.Store(int64(max(time.Since(newest), 0)))
	}
	return nil
}

// retry calls fn until it returns nil or an ErrRecordRejected, pacing
// other errors with WriteBackoff; it gives up if ctx ends or the
// connection is lost meanwhile.
func (c *Consumer) retry(ctx context.Context, conn *amqp.Connection, op string, fn func(context.Context) error) error {
	var bo backoff.BackOff
	var since time.Time
	for {
		start := time.Now()
		err := fn(ctx)
		if err == nil {
			if bo != nil {
				c.cfg.Logger.Info("Audit store writable again", watermill.LogFields{"outage": time.Since(since).String()})
			}
			return nil
		}
		c.failures.Add(1)
		if errors.Is(err, ErrRecordRejected) {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if bo == nil {
			bo, since = c.cfg.WriteBackoff(), start
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			wait = 30 * time.Second
		}
		c.cfg.Logger.Error("Audit store "+op+" failed; records stay unacked in RabbitMQ, retrying", err, watermill.LogFields{
			"retry_in": wait.String(), "outage": time.Since(since).String(),
		})
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		if conn.IsClosed() {
			return errors.New("audit: connection lost while the store was down; the broker redelivers the batch")
		}
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// deliveryOnlyHeaders describe the audit queue's delivery, not the publish:
// left out of Arrival.Headers and of its ID (a redelivery must map to the
// same record).
var deliveryOnlyHeaders = map[string]bool{retrymeta.XDeliveryCountKey: true, retrymeta.XAcquiredCountKey: true}

// errUntrusted is logged for an attempt record whose user-id is not one
// of ConsumerConfig.RecorderUsers.
var errUntrusted = errors.New("audit: attempt record's user-id is absent or not one of ConsumerConfig.RecorderUsers")

// trusted reports whether an attempt record published with this
// (broker-validated) user-id is stored.
func (c *Consumer) trusted(userID string) bool {
	if userID == "" {
		return c.cfg.AcceptRecordsWithoutUserID
	}
	for _, u := range c.cfg.RecorderUsers {
		if u == userID {
			return true
		}
	}
	return false
}

// arrival converts a delivery of the arrivals queue and gives it its
// per-publish ID (publishIDs).
func (c *Consumer) arrival(d amqp.Delivery) Arrival {
	a := ArrivalFromDelivery(d, c.cfg.UUIDHeader, c.cfg.BodyLimit, time.Now())
	if c.log != nil {
		a.ID = newArrivalID(a.contentID) // a redelivery's is resolved before its write (claimRedelivered)
	} else {
		c.ids.assign(&a, d.Redelivered)
	}
	return a
}

// TimestampErrorProperty is the Arrival.Properties key noting an AMQP
// timestamp outside years 1-9999 (its value in seconds); PublishedAt is
// then zero (stored as absent), never a wrong date.
const TimestampErrorProperty = "rabbitretry-timestamp-error"

// ArrivalFromDelivery converts a delivery of the arrivals queue into an
// Arrival, arrived at now: the message id is the uuidHeader header (else
// the message-id property); PublishedAt the timestamp property, unless it
// is outside years 1-9999 (then zero, and TimestampErrorProperty says
// why); headers become JSON values
// (amqpretry.HeadersToJSON; a header that cannot be converted is recorded
// under retrymeta.HeaderErrorKey, "rabbitretry-header-error"), without the queue's x-delivery-count
// and x-acquired-count; HeaderTable keeps them with their AMQP types; the
// body is cut to bodyLimit bytes. contentID (and ID) is the hex SHA-256
// over exchange, routing key, message id, timestamp, headers (canonical
// JSON: keys sorted) and the whole body: the same for a redelivery and for
// an identical publish; the Consumer replaces ID with a per-publish one.
func ArrivalFromDelivery(d amqp.Delivery, uuidHeader string, bodyLimit int, now time.Time) Arrival {
	a := Arrival{
		CorrelationID: d.CorrelationId, Exchange: d.Exchange, RoutingKey: d.RoutingKey,
		ArrivedAt: now.UTC(), BodySize: len(d.Body),
	}
	if s, ok := d.Headers[uuidHeader].(string); ok && s != "" {
		a.MessageID = s
	} else {
		a.MessageID = d.MessageId
	}
	var tsNote string
	if !d.Timestamp.IsZero() {
		if y := d.Timestamp.Year(); y >= 1 && y <= 9999 {
			a.PublishedAt = d.Timestamp.UTC()
		} else {
			// An AMQP timestamp is any 64-bit count of seconds; only years
			// 1-9999 are a date a store, JSON and RFC 3339 keep exactly.
			tsNote = fmt.Sprintf("AMQP timestamp %d s is outside years 1-9999; published_at left empty", d.Timestamp.Unix())
		}
	}
	var hdrs amqp.Table
	if len(d.Headers) > 0 {
		hdrs = make(amqp.Table, len(d.Headers))
		for k, v := range d.Headers {
			if !deliveryOnlyHeaders[k] {
				hdrs[k] = v
			}
		}
	}
	h, err := amqpretry.HeadersToJSON(hdrs)
	if err != nil {
		h = map[string]any{retrymeta.HeaderErrorKey: err.Error()}
	}
	if len(h) > 0 {
		a.Headers, a.HeaderTable = h, hdrs
	}
	props := map[string]string{}
	set := func(k, v string) {
		if v != "" {
			props[k] = v
		}
	}
	set("content-type", d.ContentType)
	set("content-encoding", d.ContentEncoding)
	if d.DeliveryMode != 0 {
		set("delivery-mode", strconv.Itoa(int(d.DeliveryMode)))
	}
	if d.Priority != 0 {
		set("priority", strconv.Itoa(int(d.Priority)))
	}
	set("reply-to", d.ReplyTo)
	set("expiration", d.Expiration)
	set("type", d.Type)
	set("user-id", d.UserId)
	set("app-id", d.AppId)
	set(TimestampErrorProperty, tsNote)
	if len(props) > 0 {
		a.Properties = props
	}
	a.Body = d.Body
	if bodyLimit < 0 {
		bodyLimit = 0
	}
	if len(a.Body) > bodyLimit {
		a.Body, a.BodyTruncated = bytes.Clone(a.Body[:bodyLimit]), true
	}
	if a.Body == nil {
		a.Body = []byte{}
	}
	hh, _ := json.Marshal(a.Headers) // maps marshal with sorted keys
	sum := sha256.New()
	var ts [8]byte
	binary.BigEndian.PutUint64(ts[:], uint64(d.Timestamp.Unix()))
	for _, f := range [][]byte{[]byte(d.Exchange), []byte(d.RoutingKey), []byte(a.MessageID), ts[:], hh, d.Body} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(f)))
		sum.Write(n[:])
		sum.Write(f)
	}
	a.ID = hex.EncodeToString(sum.Sum(nil))
	a.contentID = a.ID
	return a
}
