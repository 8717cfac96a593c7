package confirm

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// PublishIDHeader is the AMQP header that Publisher adds to every
// message it publishes. Its value is a string "<instance>-<channel-index>-<seq>"
// that is unique per publish attempt within one Publisher (the
// <instance> part is random per Publisher, so values from different
// publishers practically never collide).
//
// The header exists so that a basic.return (which carries the returned
// message's properties but no delivery tag) can be matched to the publish it
// belongs to; see the RabbitMQ "Publishers" guide, section on unroutable
// messages and the mandatory flag.
//
// The broker cannot strip headers, so the header stays on the delivered
// message and consumers will see it. It identifies one publish attempt, not a
// message: re-publishing a message gives it a new value (an existing value in
// the caller's headers is overwritten). Do not use it for deduplication of
// logical messages; use amqp.Publishing.MessageId for that.
const PublishIDHeader = "rabbitretry-publish-id"

// defaultConnectionName is the client-provided connection name
// (client property connection_name; RabbitMQ "Connections" guide,
// "Client-Provided Connection Name": shown by rabbitmqctl list_connections
// and the management UI) of the publisher's connections unless
// Config.ConnectionName sets another.
const defaultConnectionName = "rabbitretry-confirm-publisher"

// Sentinel errors returned (wrapped) by Publisher. Test with errors.Is.
var (
	// ErrUnroutable means the broker returned the message with basic.return
	// because it was published with mandatory=true and no queue was bound
	// that matched the exchange and routing key (RabbitMQ "Publishers" guide,
	// "Unroutable Message Handling"). The message was NOT enqueued anywhere.
	// The wrapping error names the exchange, routing key and the broker's
	// reply code and text (typically 312 NO_ROUTE).
	ErrUnroutable = errors.New("confirm: message unroutable (returned by broker)")

	// ErrNacked means the broker answered the publish with basic.nack
	// (RabbitMQ "Consumer Acknowledgements and Publisher Confirms": a nack is
	// sent when the broker could not take responsibility for the message, e.g.
	// a queue with x-overflow=reject-publish is full, or an internal error in
	// the queue process). The message must be treated as not published.
	ErrNacked = errors.New("confirm: publish nacked by broker")

	// ErrConfirmTimeout means no publisher confirm (basic.ack / basic.nack)
	// arrived within Config.ConfirmTimeout after the message was
	// written to the channel. The message may or may not have been enqueued;
	// callers must treat it as failed (e.g. not ack the message they were
	// forwarding) and may republish, accepting a possible duplicate.
	ErrConfirmTimeout = errors.New("confirm: timed out waiting for publisher confirm")

	// ErrClosed is returned by every Publisher method called after
	// Close, and (wrapped together with ErrChannelClosed) for publishes that
	// were still waiting for a confirm when Close gave up waiting.
	ErrClosed = errors.New("confirm: publisher closed")

	// ErrChannelClosed means the AMQP channel (or its connection) closed after
	// the message was written but before its confirm arrived: for instance the
	// broker closed the channel with 404 NOT_FOUND because the exchange does
	// not exist, the connection was lost, or the broker was restarted. The
	// outcome is unknown (the message may or may not have been routed), so
	// callers must treat the publish as failed and not ack the original. When
	// the broker sent a reason, the error also wraps the *amqp.Error (use
	// errors.As to get its Code, e.g. 404). Other publishes in flight on the
	// same channel fail with this error too; the channel is reopened
	// automatically on the next publish.
	ErrChannelClosed = errors.New("confirm: channel closed before publish was confirmed")

	// ErrBlocked means the broker is blocking this publisher's connection
	// (RabbitMQ "Blocked Connection Notifications" and "Memory and Disk
	// Alarms": while a memory or disk alarm is in effect the broker sends
	// connection.blocked to a connection that publishes and stops reading
	// from it until connection.unblocked). While the connection is blocked a
	// publish fails at once with ErrBlocked and nothing is written, so the
	// message was NOT published; Channel fails the same way. A publish that
	// was already written when the block arrived waits up to 1 s more for its
	// confirm (messages the broker read before blocking are confirmed), then
	// fails with ErrBlocked too; its outcome is then unknown (the broker may
	// enqueue it once it unblocks), as with ErrConfirmTimeout. The wrapping
	// error carries the broker's reason, e.g. "low on memory".
	ErrBlocked = errors.New("confirm: broker is blocking publishers (connection.blocked)")

	// ErrWriteTimeout means writing the message to the connection's socket
	// did not finish within Config.ConfirmTimeout (at least 1 s; the
	// deadline applies to each write of a frame): the broker stopped
	// reading (flow control, see ErrBlocked) or the network stalled. The
	// connection is closed (amqp091-go closes it on a write error), so the
	// partly written message is discarded by the broker; every other publish
	// in flight on the connection fails with ErrChannelClosed, and the next
	// publish redials. Only connections the publisher dials itself (URI /
	// AmqpConfig, not Config.Dial) have this write deadline.
	ErrWriteTimeout = errors.New("confirm: writing the message to the broker timed out")
)

const (
	defaultPublisherChannels       = 2
	maxPublisherChannels           = 64
	defaultPublisherConfirmTimeout = 30 * time.Second

	// reopenAttempts bounds how often one publish tries to (re)open a channel
	// (and, if needed, redial the connection) before returning the error.
	reopenAttempts        = 5
	reopenInitialInterval = 100 * time.Millisecond
	reopenMaxInterval     = time.Second

	// connectionCloseTimeout bounds the connection.close handshake in Close.
	connectionCloseTimeout = 5 * time.Second

	// defaultDialTimeout is amqp091-go's TCP dial and handshake timeout
	// (DialConfig), used unless the URI has connection_timeout or
	// AmqpConfig.Dial is set.
	defaultDialTimeout = 30 * time.Second

	// maxInFlightPerChannel bounds the publishes awaiting their confirm on
	// one channel; the channel's basic.return buffer has as many slots, so
	// amqp091-go never has to wait for (or drop, after 5 s) a return.
	maxInFlightPerChannel = 512

	// blockedGrace is how long a publish written before its connection got
	// blocked still waits for its confirm.
	blockedGrace = time.Second

	// logQueueSize bounds the log entries waiting for the user's logger.
	logQueueSize = 256

	// minIOTimeout is the floor of the socket write deadline and of the
	// channel.open bound (ConfirmTimeout otherwise): shorter ones would drop
	// healthy connections on ordinary hiccups.
	minIOTimeout = time.Second
)

// Config configures a Publisher. Zero values are replaced by
// the defaults documented on each field (see setDefaults); Validate reports
// the first invalid field by name.
type Config struct {
	// URI is the AMQP URI of the broker, e.g.
	// "amqp://guest:guest@127.0.0.1:5672/"; amqps:// for TLS (RabbitMQ
	// "TLS Support"), with the optional query parameters amqp091-go parses
	// (heartbeat, connection_timeout in ms, channel_max, ...). Required unless
	// Dial is set.
	URI string

	// AmqpConfig, when set, is the amqp091-go configuration every connection
	// to URI is dialled with (amqp.DialConfig): TLSClientConfig, Heartbeat,
	// Dial (the TCP dialer, e.g. amqp.DefaultDial(5*time.Second) for a dial
	// timeout), Vhost, SASL, ChannelMax, FrameSize, Locale and Properties. It
	// is not modified (Properties and TLSClientConfig are copied per dial).
	// The connection_name property is always ConnectionName. Recovery must be
	// nil: Publisher reconnects itself and relies on channels staying
	// closed once closed. Default nil: amqp091-go's defaults (heartbeat 10 s,
	// 30 s dial timeout, TLS config from an amqps URI). amqpretry.New passes
	// the subscriber's watermill-amqp Connection settings here.
	AmqpConfig *amqp.Config

	// ConnectionName is the client-provided connection name of the
	// publisher's connections (RabbitMQ "Connections", client-provided
	// connection name). Default "rabbitretry-confirm-publisher". Not used with
	// Dial.
	ConnectionName string

	// Dial, when set, is used instead of URI and AmqpConfig to open every
	// connection (the initial one and redials after the connection was
	// lost). The returned connection is owned by the publisher and closed by
	// Close. It must NOT have amqp.Config.Recovery enabled: Publisher
	// does its own reconnection and relies on channels staying closed once
	// closed. Writes on such a connection have no deadline (see
	// ErrWriteTimeout): prefer AmqpConfig.Dial for a custom TCP dialer.
	Dial func() (*amqp.Connection, error)

	// Channels is the number of AMQP channels, each in confirm mode, that
	// publishes are spread over round-robin. Default 2; valid range 1..64.
	Channels int

	// ConfirmTimeout is how long a publish waits for the broker's confirm
	// after writing the message before returning ErrConfirmTimeout; for
	// PublishRawBatch it is measured from the last write of the batch. It
	// also bounds every socket write of the connections the publisher dials
	// itself (ErrWriteTimeout) and every channel.open, but never below 1 s,
	// and how long Close waits for in-flight publishes. Default 30s; must be
	// > 0.
	ConfirmTimeout time.Duration

	// maxInFlight overrides maxInFlightPerChannel (tests).
	maxInFlight int

	// Logger receives connection, channel and flow-control events. It is
	// called from one goroutine of the publisher's own, never while a
	// publish or a confirm is being handled, so a slow logger cannot delay
	// or change a publish's result; when 256 entries are waiting for it,
	// further ones are dropped (and counted in the next entry). Default
	// watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
}

// setDefaults fills zero fields with their defaults: Channels=2,
// ConfirmTimeout=30s, ConnectionName=defaultConnectionName,
// Logger=watermill.NopLogger{}.
func (c *Config) setDefaults() {
	if c.Channels == 0 {
		c.Channels = defaultPublisherChannels
	}
	if c.ConfirmTimeout == 0 {
		c.ConfirmTimeout = defaultPublisherConfirmTimeout
	}
	if c.ConnectionName == "" {
		c.ConnectionName = defaultConnectionName
	}
	if c.maxInFlight == 0 {
		c.maxInFlight = maxInFlightPerChannel
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate returns an error naming the first invalid field: URI missing (and
// Dial nil) or not a valid AMQP URI, both Dial and AmqpConfig set,
// AmqpConfig.Recovery set, Channels outside 1..64, ConfirmTimeout <= 0, or
// Logger nil. Call it after defaults were applied (New does
// both).
func (c Config) Validate() error {
	if c.Dial == nil {
		if c.URI == "" {
			return errors.New("confirm: Config.URI is required when Dial is nil")
		}
		if _, err := amqp.ParseURI(c.URI); err != nil {
			return fmt.Errorf("confirm: Config.URI is invalid: %w", redact.Error(err, c.URI))
		}
	} else if c.AmqpConfig != nil {
		return errors.New("confirm: Config.AmqpConfig is not used with Dial; set one of them")
	}
	if c.AmqpConfig != nil && c.AmqpConfig.Recovery != nil {
		return errors.New("confirm: Config.AmqpConfig.Recovery must be nil (the publisher reconnects itself)")
	}
	if c.Channels < 1 || c.Channels > maxPublisherChannels {
		return fmt.Errorf("confirm: Config.Channels must be in 1..%d, got %d", maxPublisherChannels, c.Channels)
	}
	if c.ConfirmTimeout <= 0 {
		return fmt.Errorf("confirm: Config.ConfirmTimeout must be > 0, got %s", c.ConfirmTimeout)
	}
	if c.Logger == nil {
		return errors.New("confirm: Config.Logger must not be nil")
	}
	return nil
}
