package audit

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Default names of the audit topology.
const (
	// DefaultExchange is the direct exchange the Recorder publishes attempt
	// records to.
	DefaultExchange = "rabbitretry.audit"
	// DefaultAttemptsQueue holds attempt records until the Consumer has
	// written them to the Store; bound to the audit exchange with
	// AttemptRoutingKey.
	DefaultAttemptsQueue = "rabbitretry.audit.attempts"
	// DefaultArrivalsQueue receives one copy of every message published to
	// an audited business exchange (bound by the Consumer).
	DefaultArrivalsQueue = "rabbitretry.audit.arrivals"
	// AttemptRoutingKey is the routing key of attempt records.
	AttemptRoutingKey = "attempt"
)

// Queue types of the audit queues ("Quorum Queues", "Classic Queues").
const (
	// QueueTypeQuorum: replicated, durable, publisher confirms once a
	// majority stored the record. The default.
	QueueTypeQuorum = "quorum"
	// QueueTypeClassic: a durable classic queue (single node).
	QueueTypeClassic = "classic"
)

// Naming names the audit exchange and queues. Zero fields take the
// Default* names. Recorder and Consumer must use the same Naming.
type Naming struct {
	// Exchange is the audit exchange (direct, durable). Default
	// DefaultExchange.
	Exchange string
	// AttemptsQueue is the queue of attempt records. Default
	// DefaultAttemptsQueue.
	AttemptsQueue string
	// ArrivalsQueue is the queue of arrivals. Default DefaultArrivalsQueue.
	ArrivalsQueue string
}

// WithDefaults returns n with empty fields set to the default names.
func (n Naming) WithDefaults() Naming {
	if n.Exchange == "" {
		n.Exchange = DefaultExchange
	}
	if n.AttemptsQueue == "" {
		n.AttemptsQueue = DefaultAttemptsQueue
	}
	if n.ArrivalsQueue == "" {
		n.ArrivalsQueue = DefaultArrivalsQueue
	}
	return n
}

// validate reports a name RabbitMQ would refuse (longer than 255 bytes).
func (n Naming) validate(field string) error {
	for name, v := range map[string]string{"Exchange": n.Exchange, "AttemptsQueue": n.AttemptsQueue, "ArrivalsQueue": n.ArrivalsQueue} {
		if len(v) > 255 {
			return fmt.Errorf("audit: %s.Naming.%s is %d bytes, longer than RabbitMQ's 255", field, name, len(v))
		}
	}
	return nil
}

func checkQueueType(field, qt string) error {
	if qt != QueueTypeQuorum && qt != QueueTypeClassic {
		return fmt.Errorf("audit: %s.QueueType %q is neither %q nor %q", field, qt, QueueTypeQuorum, QueueTypeClassic)
	}
	return nil
}

func queueArgs(queueType string) amqp.Table {
	if queueType == QueueTypeQuorum {
		return amqp.Table{"x-queue-type": QueueTypeQuorum}
	}
	return nil
}

// DeclareAttempts declares the audit exchange (direct, durable) and the
// attempts queue (durable, of queueType) bound to it with
// AttemptRoutingKey. Idempotent; a queue that exists with another type
// fails with the broker's 406 PRECONDITION_FAILED (which closes ch),
// wrapped with the queue's name.
func DeclareAttempts(ch *amqp.Channel, n Naming, queueType string) error {
	n = n.WithDefaults()
	if err := ch.ExchangeDeclare(n.Exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		return fmt.Errorf("audit: declaring exchange %q: %w", n.Exchange, err)
	}
	if err := declareQueue(ch, n.AttemptsQueue, queueType); err != nil {
		return err
	}
	if err := ch.QueueBind(n.AttemptsQueue, AttemptRoutingKey, n.Exchange, false, nil); err != nil {
		return fmt.Errorf("audit: binding %q to %q: %w", n.AttemptsQueue, n.Exchange, err)
	}
	return nil
}

func declareQueue(ch *amqp.Channel, q, queueType string) error {
	if _, err := ch.QueueDeclare(q, true, false, false, false, queueArgs(queueType)); err != nil {
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed {
			return fmt.Errorf("audit: queue %q exists with other arguments (QueueType %q wanted): %w", q, queueType, err)
		}
		return fmt.Errorf("audit: declaring queue %q: %w", q, err)
	}
	return nil
}

// DeleteTopology deletes the audit queues (with the records in them) and
// the audit exchange; missing ones are not an error. Meant for tests and
// decommissioning.
func DeleteTopology(ch *amqp.Channel, n Naming) error {
	n = n.WithDefaults()
	var errs []error
	for _, q := range []string{n.AttemptsQueue, n.ArrivalsQueue} {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			errs = append(errs, fmt.Errorf("audit: deleting queue %q: %w", q, err))
		}
	}
	if err := ch.ExchangeDelete(n.Exchange, false, false); err != nil {
		errs = append(errs, fmt.Errorf("audit: deleting exchange %q: %w", n.Exchange, err))
	}
	return errors.Join(errs...)
}
