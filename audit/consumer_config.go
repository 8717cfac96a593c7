package audit

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// Consumer defaults.
const (
	// defaultBatchSize is the default number of records per Store.Write.
	defaultBatchSize = auditconst.BatchSize
	// defaultWriters is the default number of Store.Write calls in flight.
	defaultWriters = 4
	// defaultBatchWait is the default longest wait for a batch to fill.
	defaultBatchWait = 200 * time.Millisecond
	// defaultBodyLimit is the default number of body bytes kept per arrival.
	defaultBodyLimit = 256 << 10
	// defaultUUIDHeader is watermill-amqp's header of the message UUID.
	defaultUUIDHeader = "_watermill_message_uuid"
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
	// QueueType of the audit queues: "quorum" (default) or "classic"
	// (amqpretry.QueueTypeQuorum, amqpretry.QueueTypeClassic).
	QueueType string
	// Naming names the audit exchange and queues; the Recorder must use the
	// same. Default: the default names (see Naming).
	Naming Naming
	// UUIDHeader is the header holding the Watermill message UUID (the
	// Marshaler's). Default "_watermill_message_uuid"; without it, the AMQP
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
	c.Naming = c.Naming.withDefaults()
	if c.BatchSize == 0 {
		c.BatchSize = defaultBatchSize
	}
	if c.Writers == 0 {
		c.Writers = defaultWriters
	}
	if c.BatchWait == 0 {
		c.BatchWait = defaultBatchWait
	}
	if c.BodyLimit == 0 {
		c.BodyLimit = defaultBodyLimit
	}
	if c.QueueType == "" {
		c.QueueType = queueTypeQuorum
	}
	if c.UUIDHeader == "" {
		c.UUIDHeader = defaultUUIDHeader
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
