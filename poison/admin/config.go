package admin

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Config configures an Admin. Zero fields take the defaults documented on
// each field; New applies them and then calls Validate.
type Config struct {
	// URI is the AMQP URI of the broker, e.g.
	// "amqp://guest:guest@127.0.0.1:5672/"; its vhost is the vhost of every
	// queue named in the Admin's methods. Required.
	URI string

	// LoopBackExchange is the direct exchange Replay publishes to, with the
	// message's original queue as routing key: each originating queue Q is
	// bound to it with routing key Q (see amqpretry.Topology), so a replayed
	// message reaches Q only, not the other queues bound to Q's business
	// exchange. Must equal the amqpretry.Naming.LoopBackExchange of the
	// consumers. Default "rabbitretry.loopback".
	LoopBackExchange string

	// ConnectionName is the client-provided connection name the broker
	// shows for the Admin's connection (management UI, rabbitmqctl
	// list_connections). Default "rabbitretry-poison-admin".
	ConnectionName string

	// Logger logs the outcome of each modifying operation (Info) and failed
	// publishes (Error). Default watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.LoopBackExchange == "" {
		c.LoopBackExchange = retrymeta.DefaultLoopBackExchange
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate returns an error naming the first invalid field: URI empty or not
// a valid AMQP URI, LoopBackExchange empty or longer than 255 bytes, Logger
// nil. New calls it after applying the defaults.
func (c Config) Validate() error {
	if c.URI == "" {
		return errors.New("poison/admin: Config.URI is required")
	}
	if _, err := amqp.ParseURI(c.URI); err != nil {
		return fmt.Errorf("poison/admin: Config.URI is invalid: %w", redact.Error(err, c.URI))
	}
	if c.LoopBackExchange == "" {
		return errors.New("poison/admin: Config.LoopBackExchange is empty")
	}
	if len(c.LoopBackExchange) > maxNameBytes {
		return fmt.Errorf("poison/admin: Config.LoopBackExchange is %d bytes, more than RabbitMQ's %d", len(c.LoopBackExchange), maxNameBytes)
	}
	if c.Logger == nil {
		return errors.New("poison/admin: Config.Logger is nil")
	}
	return nil
}

// maxNameBytes is RabbitMQ's limit on queue and exchange names.
const maxNameBytes = 255

// Sentinel errors. Test with errors.Is; the returned errors carry the
// details (queue or exchange name, UUID).
var (
	// ErrQueueNotFound: the named queue does not exist in the URI's vhost
	// (the passive queue.declare failed with 404 NOT_FOUND, "Queues" guide).
	// The error is a *notFoundError naming the queue.
	ErrQueueNotFound = errors.New("queue does not exist")

	// ErrExchangeNotFound: the loop-back exchange does not exist (passive
	// exchange.declare failed with 404 NOT_FOUND). Returned by Replay, which
	// then changes nothing. The error is a *notFoundError.
	ErrExchangeNotFound = errors.New("exchange does not exist")

	// ErrNoOriginalQueue: a message to replay carries no
	// rabbitretry-original-queue header and ReplayOptions.DefaultQueue is
	// empty, so Replay does not know where to send it. It is left in the
	// poison queue and reported in ReplayResult.Errors as a *MessageError.
	ErrNoOriginalQueue = errors.New("message has no rabbitretry-original-queue header and no ReplayOptions.DefaultQueue was given")
)

// notFoundError reports a queue or exchange that does not exist. It matches
// ErrQueueNotFound or ErrExchangeNotFound with errors.Is, by Kind.
type notFoundError struct {
	// Kind is "queue" or "exchange".
	Kind string
	// Name is the queue or exchange name.
	Name string
	// Err is the broker's error (an *amqp.Error with code 404).
	Err error
}

// Error says which queue or exchange does not exist.
func (e *notFoundError) Error() string {
	return fmt.Sprintf("poison/admin: %s %q does not exist", e.Kind, e.Name)
}

// Unwrap returns the broker's error.
func (e *notFoundError) Unwrap() error { return e.Err }

// Is matches ErrQueueNotFound for Kind "queue" and ErrExchangeNotFound for
// Kind "exchange".
func (e *notFoundError) Is(target error) bool {
	switch e.Kind {
	case "queue":
		return target == ErrQueueNotFound
	case "exchange":
		return target == ErrExchangeNotFound
	}
	return false
}

// MessageError is the failure of one message in a Replay; the message stays
// in (or returns to) the poison queue unless stated otherwise.
type MessageError struct {
	// UUID is the message's Watermill UUID ("" if it has none).
	UUID string
	// Queue is the queue the message was to be replayed to ("" if unknown).
	Queue string
	// Err is the cause, e.g. ErrNoOriginalQueue or confirm.ErrUnroutable
	// (no binding on the loop-back exchange for Queue).
	Err error
}

// Error names the message, the destination queue if known, and the cause.
func (e *MessageError) Error() string {
	if e.Queue == "" {
		return fmt.Sprintf("message %q: %v", e.UUID, e.Err)
	}
	return fmt.Sprintf("message %q to queue %q: %v", e.UUID, e.Queue, e.Err)
}

// Unwrap returns the cause.
func (e *MessageError) Unwrap() error { return e.Err }

// errClosed is returned by every method called after Close
// (middleware.ErrClosed, wrapped).
var errClosed = fmt.Errorf("poison/admin: admin: %w", middleware.ErrClosed)
