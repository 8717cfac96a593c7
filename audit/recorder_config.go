package audit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"

	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// Recorder defaults.
const (
	// defaultBuffer is the default number of attempt records held in memory
	// waiting for the background publisher.
	defaultBuffer = 10_000
	// defaultPublishBatch is the default number of records published back
	// to back (pipelined) before waiting for their confirms.
	defaultPublishBatch = 256
)

// errRecorderClosed is counted (Stats.Rejected) and logged for a record
// made after Close: it is not published.
var errRecorderClosed = fmt.Errorf("audit: recorder: %w", middleware.ErrClosed)

// RecorderConfig configures a Recorder. Zero values take the defaults
// documented per field.
type RecorderConfig struct {
	// URI is the AMQP URI of the broker the records are published to.
	// Required unless Publisher is set.
	URI string
	// Publisher, when set, publishes the records (a ConfirmPublisher shared
	// with other code; amqpretry's own is made after the Recorder, which
	// its Config.Observer needs, so it cannot be passed here); the Recorder
	// does not close it. Default: the Recorder's own ConfirmPublisher on URI
	// (mandatory publishes with publisher confirms, reconnecting, connection
	// name "rabbitretry-audit-recorder"), closed by Close.
	Publisher *confirm.Publisher
	// UserID is the AMQP user-id property of every record: the RabbitMQ
	// user the records are published as. RabbitMQ checks it against the
	// publishing connection's user and refuses a mismatch (channel error
	// 406 PRECONDITION_FAILED: "Validated User-ID", the "Publishers"
	// guide), so a record carrying it was published by that user; the
	// Consumer stores only records of its ConsumerConfig.RecorderUsers.
	// Default: the user of URI (amqp.ParseURI; "guest" if the URI names
	// none); set it when the connection authenticates otherwise (SASL
	// EXTERNAL: the certificate's user). Required when Publisher is set
	// without URI: the user that Publisher connects as.
	UserID string
	// Naming names the audit exchange and attempts queue; the Consumer must
	// use the same. Default: "rabbitretry.audit",
	// "rabbitretry.audit.attempts".
	Naming Naming
	// QueueType of the attempts queue: "quorum" (default) or "classic"
	// (amqpretry.QueueTypeQuorum, amqpretry.QueueTypeClassic).
	QueueType string
	// Buffer is how many records may wait in memory for the publisher.
	// When it is full, the recording call (the Middleware, after the chain
	// returned) BLOCKS until there is room: backpressure on the consumer,
	// never a dropped record. Default 10,000; must be >= 1.
	Buffer int
	// PublishBatch is how many records are written back to back before
	// their confirms are awaited. Default 256; range
	// 1..512.
	PublishBatch int
	// Publishers is the number of goroutines publishing batches
	// concurrently (each waits for its batch's confirms), so that one
	// batch's confirm round trip does not stall the next. Default 2; range
	// 1..16.
	Publishers int
	// QueueName names the originating queue of a message. Default the
	// router's subscribe topic (message.SubscribeTopicFromCtx); with
	// amqpretry pass the same function as amqpretry.Config.QueueName.
	QueueName func(ctx context.Context) string
	// TierFor maps a scheduled retry's delay to the wait-queue tier that
	// holds it (Attempt.Tier), e.g. func(_ string, d time.Duration)
	// time.Duration { return retry.Topology().TierFor(d) }. Default: no
	// tier recorded (0).
	TierFor func(queue string, d time.Duration) time.Duration
	// ErrorText renders the handler error into Attempt.Error; use the same
	// redaction as the retry chain. Default retrymeta.ErrorText(err,
	// retrymeta.DefaultMaxErrorBytes), the chain's default.
	ErrorText func(error) string
	// Classifier gives Attempt.ErrorClass of a handler error. Default
	// middleware.DefaultClassifier; pass the chain's (Chain().Classifier)
	// when it has rules of its own. A poisoning's class (Observer.Poisoned)
	// and a classification the chain returned take precedence.
	Classifier *middleware.Classifier
	// RetryBackoff paces republishing a batch the broker did not confirm.
	// Default: exponential from 100 ms, factor 2, capped at 10 s, forever
	// (until Close gives up).
	RetryBackoff func() backoff.BackOff
	// Logger logs publish failures and their recovery. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *RecorderConfig) setDefaults() {
	c.Naming = c.Naming.withDefaults()
	if c.UserID == "" && c.URI != "" {
		if u, err := amqp.ParseURI(c.URI); err == nil {
			c.UserID = u.Username
		}
	}
	if c.QueueType == "" {
		c.QueueType = queueTypeQuorum
	}
	if c.Buffer == 0 {
		c.Buffer = defaultBuffer
	}
	if c.PublishBatch == 0 {
		c.PublishBatch = defaultPublishBatch
	}
	if c.Publishers == 0 {
		c.Publishers = 2
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.ErrorText == nil {
		c.ErrorText = func(err error) string { return retrymeta.ErrorText(err, retrymeta.DefaultMaxErrorBytes) }
	}
	if c.Classifier == nil {
		c.Classifier = middleware.DefaultClassifier
	}
	if c.RetryBackoff == nil {
		c.RetryBackoff = func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval = 100 * time.Millisecond
			b.MaxInterval = 10 * time.Second
			b.MaxElapsedTime = 0
			b.Reset()
			return b
		}
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field. NewRecorder calls it after filling
// in defaults.
func (c RecorderConfig) Validate() error {
	if c.Publisher == nil && c.URI == "" {
		return errors.New("audit: RecorderConfig.URI is empty and no Publisher is set")
	}
	if c.Publisher == nil {
		if _, err := amqp.ParseURI(c.URI); err != nil {
			return fmt.Errorf("audit: RecorderConfig.URI is invalid: %w", redact.Error(err, c.URI))
		}
	}
	if c.UserID == "" {
		return errors.New("audit: RecorderConfig.UserID is empty: set the user the Publisher connects as (the Consumer stores only records whose validated user-id it trusts)")
	}
	if c.Buffer < 1 {
		return fmt.Errorf("audit: RecorderConfig.Buffer %d is below 1", c.Buffer)
	}
	if c.PublishBatch < 1 || c.PublishBatch > 512 {
		return fmt.Errorf("audit: RecorderConfig.PublishBatch %d is outside 1..512", c.PublishBatch)
	}
	if c.Publishers < 1 || c.Publishers > 16 {
		return fmt.Errorf("audit: RecorderConfig.Publishers %d is outside 1..16", c.Publishers)
	}
	if err := checkQueueType("RecorderConfig", c.QueueType); err != nil {
		return err
	}
	return c.Naming.validate("RecorderConfig")
}

// RecorderStats are the Recorder's counters.
type RecorderStats struct {
	// Recorded is the number of attempt records made.
	Recorded uint64
	// Published is the number confirmed by the broker.
	Published uint64
	// Buffered is the number in memory now (queued or being published).
	Buffered int
	// PublishFailures counts failed publish rounds (each retried).
	PublishFailures uint64
	// Rejected counts records made after Close (not published).
	Rejected uint64
}
