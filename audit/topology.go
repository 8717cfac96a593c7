package audit

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

// Default names of the audit topology.
const (
	// defaultExchange is the direct exchange the Recorder publishes attempt
	// records to.
	defaultExchange = "rabbitretry.audit"
	// defaultAttemptsQueue holds attempt records until the Consumer has
	// written them to the Store; bound to the audit exchange with
	// attemptRoutingKey.
	defaultAttemptsQueue = "rabbitretry.audit.attempts"
	// defaultArrivalsQueue receives one copy of every message published to
	// an audited business exchange (bound by the Consumer).
	defaultArrivalsQueue = "rabbitretry.audit.arrivals"
	// attemptRoutingKey is the routing key of attempt records.
	attemptRoutingKey = auditconst.AttemptRoutingKey
	// setAsideRoutingKey is the dead-letter routing key of the audit
	// queues (x-dead-letter-routing-key): it routes to the set-aside queue.
	setAsideRoutingKey = "set-aside"
	// deliveryLimit is the x-delivery-limit the quorum audit queues are
	// declared with. RabbitMQ 4.x gives quorum queues a delivery limit of
	// 20 by default, and every connection loss counts as a delivery of each
	// record a consumer held unacked ("Quorum Queues", "Poison Message
	// Handling" and "When is delivery count incremented?"): records held
	// while PostgreSQL is down would be dropped after about 20 connection
	// losses. 1000 tolerates that many; past it a record is dead-lettered
	// (at-least-once) to the set-aside queue, never dropped. The limit
	// exists at all for a message the AMQP client cannot decode (a header
	// table nested deeper than 32 or with more than 8192 entries), whose
	// every delivery closes the connection: it is set aside after
	// deliveryLimit deliveries. Finite on purpose: a negative limit means
	// unlimited on 4.x but 0 on 3.x.
	deliveryLimit = 1000
)

// Queue types of the audit queues ("Quorum Queues", "Classic Queues").
const (
	// queueTypeQuorum: replicated, durable, publisher confirms once a
	// majority stored the record. The default.
	queueTypeQuorum = "quorum"
	// queueTypeClassic: a durable classic queue (single node).
	queueTypeClassic = "classic"
)

// Naming names the audit exchange and queues. Zero fields take the
// default names below. Recorder and Consumer must use the same Naming.
type Naming struct {
	// Exchange is the audit exchange (direct, durable). Default
	// "rabbitretry.audit".
	Exchange string
	// AttemptsQueue is the queue of attempt records. Default
	// "rabbitretry.audit.attempts".
	AttemptsQueue string
	// ArrivalsQueue is the queue of arrivals. Default
	// "rabbitretry.audit.arrivals".
	ArrivalsQueue string
	// SetAsideQueue holds the messages of the audit queues that could not
	// be delivered: a quorum audit queue dead-letters a message past its
	// delivery limit (1000 deliveries) to the audit exchange with the
	// routing key "set-aside", which routes it here. Nothing consumes it:
	// an operator inspects it (and may move its messages back). Default:
	// Exchange + ".set-aside" ("rabbitretry.audit.set-aside" with
	// the default Exchange).
	SetAsideQueue string
}

// withDefaults returns n with empty fields set to the default names.
func (n Naming) withDefaults() Naming {
	if n.Exchange == "" {
		n.Exchange = defaultExchange
	}
	if n.AttemptsQueue == "" {
		n.AttemptsQueue = defaultAttemptsQueue
	}
	if n.ArrivalsQueue == "" {
		n.ArrivalsQueue = defaultArrivalsQueue
	}
	if n.SetAsideQueue == "" {
		n.SetAsideQueue = n.Exchange + ".set-aside"
	}
	return n
}

// validate reports a name RabbitMQ would refuse (longer than 255 bytes).
func (n Naming) validate(field string) error {
	for _, f := range []struct{ name, v string }{{"Exchange", n.Exchange}, {"AttemptsQueue", n.AttemptsQueue},
		{"ArrivalsQueue", n.ArrivalsQueue}, {"SetAsideQueue", n.SetAsideQueue}} {
		if len(f.v) > 255 {
			return fmt.Errorf("audit: %s.Naming.%s is %d bytes, longer than RabbitMQ's 255", field, f.name, len(f.v))
		}
	}
	return nil
}

func checkQueueType(field, qt string) error {
	if qt != queueTypeQuorum && qt != queueTypeClassic {
		return fmt.Errorf("audit: %s.QueueType %q is neither %q nor %q", field, qt, queueTypeQuorum, queueTypeClassic)
	}
	return nil
}

// auditQueueArgs are the arguments of the arrivals and attempts queues: a
// quorum queue gets deliveryLimit and dead-letters (at-least-once, which
// needs overflow reject-publish; no length limit is set, so nothing is
// refused) to the audit exchange with setAsideRoutingKey.
func auditQueueArgs(queueType string, n Naming) amqp.Table {
	if queueType != queueTypeQuorum {
		return nil
	}
	return amqp.Table{
		"x-queue-type":              queueTypeQuorum,
		"x-delivery-limit":          int64(deliveryLimit),
		"x-dead-letter-exchange":    n.Exchange,
		"x-dead-letter-routing-key": setAsideRoutingKey,
		"x-dead-letter-strategy":    "at-least-once",
		"x-overflow":                "reject-publish",
	}
}

// legacyQueueArgs are the arguments audit queues were declared with before
// deliveryLimit: the queue type only.
func legacyQueueArgs(queueType string) amqp.Table {
	if queueType == queueTypeQuorum {
		return amqp.Table{"x-queue-type": queueTypeQuorum}
	}
	return nil
}

// channelOpener opens AMQP channels: an *amqp.Connection, or the
// Recorder's Publisher.
type channelOpener interface {
	Channel() (*amqp.Channel, error)
}

// declareAttemptTopology declares the audit exchange (direct, durable), the
// attempts queue (durable, of queueType) bound to it with
// attemptRoutingKey, and the set-aside queue bound with
// setAsideRoutingKey. A quorum attempts queue gets x-delivery-limit
// deliveryLimit and dead-letters to the set-aside queue. An attempts queue
// declared by an older version (without those arguments: RabbitMQ refuses
// to change a queue's arguments, 406 PRECONDITION_FAILED) is used as it
// is: see the README's "Audit" section for the policy that upgrades it.
// Idempotent. A queue that exists with another type fails with the
// broker's 406, wrapped with the queue's name. Each declaration uses its
// own channel from open, closed afterwards.
func declareAttemptTopology(open channelOpener, n Naming, queueType string) error {
	_, err := declareAttempts(open, n.withDefaults(), queueType)
	return err
}

// declareAttempts is declareAttemptTopology; legacy names the queues declared by
// an older version.
func declareAttempts(open channelOpener, n Naming, queueType string) (legacy []string, err error) {
	ch, err := open.Channel()
	if err != nil {
		return nil, fmt.Errorf("audit: opening a channel: %w", err)
	}
	defer ch.Close()
	if err := ch.ExchangeDeclare(n.Exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		return nil, fmt.Errorf("audit: declaring exchange %q: %w", n.Exchange, err)
	}
	old, err := declareQueue(open, n.AttemptsQueue, queueType, n)
	if err != nil {
		return nil, err
	}
	if old {
		legacy = append(legacy, n.AttemptsQueue)
	}
	if err := declareSetAside(open, n, queueType); err != nil {
		return nil, err
	}
	if err := ch.QueueBind(n.SetAsideQueue, setAsideRoutingKey, n.Exchange, false, nil); err != nil {
		return nil, fmt.Errorf("audit: binding %q to %q: %w", n.SetAsideQueue, n.Exchange, err)
	}
	if err := ch.QueueBind(n.AttemptsQueue, attemptRoutingKey, n.Exchange, false, nil); err != nil {
		return nil, fmt.Errorf("audit: binding %q to %q: %w", n.AttemptsQueue, n.Exchange, err)
	}
	return legacy, nil
}

// declareSetAside declares the set-aside queue (durable, of queueType; a
// quorum one with deliveryLimit, no dead-letter target). It only receives
// dead-letters, so one that exists with other arguments (an earlier
// QueueType) is used as it is.
func declareSetAside(open channelOpener, n Naming, queueType string) error {
	args := legacyQueueArgs(queueType)
	if queueType == queueTypeQuorum {
		args["x-delivery-limit"] = int64(deliveryLimit)
	}
	declare := func(passive bool) error {
		ch, err := open.Channel()
		if err != nil {
			return fmt.Errorf("audit: opening a channel: %w", err)
		}
		defer ch.Close()
		if passive {
			_, err = ch.QueueDeclarePassive(n.SetAsideQueue, true, false, false, false, nil)
		} else {
			_, err = ch.QueueDeclare(n.SetAsideQueue, true, false, false, false, args)
		}
		return err
	}
	err := declare(false)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed {
		err = declare(true)
	}
	if err != nil {
		return fmt.Errorf("audit: declaring queue %q: %w", n.SetAsideQueue, err)
	}
	return nil
}

// declareQueue declares audit queue q with auditQueueArgs; if RabbitMQ
// refuses (406: it exists with other arguments), with legacyQueueArgs on a
// new channel (legacy true). Either way the channels are closed.
func declareQueue(open channelOpener, q, queueType string, n Naming) (legacy bool, err error) {
	try := func(args amqp.Table) error {
		ch, err := open.Channel()
		if err != nil {
			return fmt.Errorf("audit: opening a channel: %w", err)
		}
		defer ch.Close()
		_, err = ch.QueueDeclare(q, true, false, false, false, args)
		return err
	}
	err = try(auditQueueArgs(queueType, n))
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed && queueType == queueTypeQuorum {
		if err = try(legacyQueueArgs(queueType)); err == nil {
			return true, nil
		}
	}
	if errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed {
		return false, fmt.Errorf("audit: queue %q exists with other arguments (QueueType %q wanted): %w", q, queueType, err)
	}
	if err != nil {
		return false, fmt.Errorf("audit: declaring queue %q: %w", q, err)
	}
	return false, nil
}

// DeleteTopology deletes the audit queues (with the records in them) and
// the audit exchange; missing ones are not an error. Meant for tests and
// decommissioning.
func DeleteTopology(ch *amqp.Channel, n Naming) error {
	n = n.withDefaults()
	var errs []error
	for _, q := range []string{n.AttemptsQueue, n.ArrivalsQueue, n.SetAsideQueue} {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			errs = append(errs, fmt.Errorf("audit: deleting queue %q: %w", q, err))
		}
	}
	if err := ch.ExchangeDelete(n.Exchange, false, false); err != nil {
		errs = append(errs, fmt.Errorf("audit: deleting exchange %q: %w", n.Exchange, err))
	}
	return errors.Join(errs...)
}
