package cascadecore

import (
	"errors"
	"fmt"
	"regexp"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/amqperr"
)

// settingsExchange is the name of the cascade's settings marker:
// "<Prefix>.settings", an internal fanout exchange that routes nothing.
// Declare declares it first, with the settings (Levels, Grain, QueueType)
// written in its alternate-exchange argument, the one exchange argument
// RabbitMQ compares on a redeclare ("Exchanges", equivalence): a second
// Declare with other settings is refused by the broker (406
// PRECONDITION_FAILED) before it binds anything, and Declare returns
// ErrSettingsMismatch naming both. The alternate exchange it names does
// not exist and is never used (nothing is published to an internal
// exchange).
func (c Config) settingsExchange() string {
	c.setDefaults()
	return c.Prefix + ".settings"
}

// settings is the marker's value: "levels=L grain=G T" (short: the
// broker's refusal, which quotes it twice, is limited to 255 bytes).
func (c *Config) settings() string {
	return fmt.Sprintf("levels=%d grain=%v %s", c.Levels, c.Grain, c.QueueType)
}

var aeValues = regexp.MustCompile(`received '([^']*)' but current is '([^']*)'`)

// declareSettings declares the settings marker (see settingsExchange).
func (c *Config) declareSettings(ch *amqp.Channel) error {
	err := ch.ExchangeDeclare(c.settingsExchange(), amqp.ExchangeFanout, true, false, true, false,
		amqp.Table{"alternate-exchange": c.settings()})
	if err == nil {
		return nil
	}
	var aerr *amqp.Error
	if errors.As(err, &aerr) && aerr.Code == amqp.PreconditionFailed {
		found := "other settings (the broker's message is truncated)"
		if m := aeValues.FindStringSubmatch(aerr.Reason); m != nil {
			found = m[2]
		}
		return fmt.Errorf("%w: prefix %q is declared with %s, this Config has %s (every process sharing a cascade must use the same Levels, Grain and QueueType; use another Prefix, or Delete the cascade once it is empty): %w",
			ErrSettingsMismatch, c.Prefix, found, c.settings(), err)
	}
	return declareError("exchange", c.settingsExchange(), err)
}

// Declare declares the whole fixed topology on ch, idempotently (RabbitMQ
// declares are no-ops when the object exists with the same arguments):
//
//   - first the settings marker (settingsExchange): if the prefix is
//     already declared with other Levels, Grain or QueueType, Declare
//     stops there with ErrSettingsMismatch (wrapped, naming both), having
//     bound nothing (the broker closes ch);
//   - the delivery exchange (topic, durable);
//   - per level n in [0, Levels): exchange "<Prefix>.level.NN" (topic,
//     durable) and queue "<Prefix>.level.NN" (durable, QueueType,
//     x-message-ttl 2^n × Grain in ms, x-dead-letter-exchange level n-1's
//     exchange or, for level 0, the delivery exchange, no
//     x-dead-letter-routing-key so the message keeps its key; quorum:
//     x-dead-letter-strategy at-least-once, x-overflow reject-publish,
//     x-delivery-limit levelDeliveryLimit);
//   - level n's exchange bound to its queue with "*." × (Levels-1-n) + "1.#"
//     and to the next exchange (exchange-to-exchange binding, RabbitMQ
//     "Exchange to Exchange Bindings") with "*." × (Levels-1-n) + "0.#".
//
// 4 × Levels + 1 operations; nothing per destination (see
// BindDestination). It returns Validate's error, or an
// *amqpretry.DeclareError (Kind "exchange", "queue" or "binding") for the
// first refused operation; the broker then closes ch (a queue declared with
// other arguments: 406 PRECONDITION_FAILED, Argument names the argument).
// Quorum level queues declared by a version without x-delivery-limit are
// refused with Argument "x-delivery-limit" and Found "none"; the Delayer
// and the Publisher then keep using them as they are and log a warning
// (see the README's upgrade note: recreate the levels once empty).
func (c Config) Declare(ch *amqp.Channel) error {
	c, err := c.resolved()
	if err != nil {
		return err
	}
	if err := c.declareSettings(ch); err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(c.DeliveryExchange(), amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return declareError("exchange", c.DeliveryExchange(), err)
	}
	for n := 0; n < c.Levels; n++ {
		name := c.LevelName(n)
		if err := ch.ExchangeDeclare(name, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return declareError("exchange", name, err)
		}
		if _, err := ch.QueueDeclare(name, true, false, false, false, c.levelArgs(n)); err != nil {
			return declareError("queue", name, err)
		}
	}
	for n := 0; n < c.Levels; n++ {
		name := c.LevelName(n)
		one, zero := c.levelPatterns(n)
		if err := ch.QueueBind(name, one, name, false, nil); err != nil {
			return declareError("binding", name, err)
		}
		if err := ch.ExchangeBind(c.nextExchange(n), zero, name, false, nil); err != nil {
			return declareError("binding", name, err)
		}
	}
	return nil
}

// BindDestination binds queue to the delivery exchange with the key
// "*." × Levels + queue, so that messages addressed to queue arrive there
// and nowhere else. Idempotent (a binding that exists is not duplicated);
// one binding per destination, no queue. The queue must exist. It returns
// Validate's error, ErrBadQueueName (wrapped), or an *amqpretry.DeclareError
// (Kind "binding"; 404 NOT_FOUND when the queue or the delivery exchange is
// missing, which closes ch).
//
// A message whose destination is unbound when it leaves the last level is
// unroutable: with classic level queues it is dropped; with quorum ones
// (at-least-once) RabbitMQ keeps it in the level queue and retries the
// dead-lettering ("Quorum Queues", at-least-once dead-lettering), so it is
// delivered once the binding exists, after up to the dead-letter worker's
// resend interval (3 min by default; see the package doc).
func (c Config) BindDestination(ch *amqp.Channel, queue string) error {
	c, err := c.resolved()
	if err != nil {
		return err
	}
	if err := c.checkQueue(queue); err != nil {
		return err
	}
	if err := ch.QueueBind(queue, c.destinationPattern(queue), c.DeliveryExchange(), false, nil); err != nil {
		return declareError("binding", queue, err)
	}
	return nil
}

// Delete deletes the level queues (with every message waiting in them),
// the level exchanges, the delivery exchange and the settings marker
// (unconditionally; missing
// ones are not an error: queue.delete and exchange.delete of a missing
// object succeed on RabbitMQ 3.10+). For tests and decommissioning. It
// returns Validate's error or the first broker error.
func (c Config) Delete(ch *amqp.Channel) error {
	c, err := c.resolved()
	if err != nil {
		return err
	}
	for n := 0; n < c.Levels; n++ {
		if _, err := ch.QueueDelete(c.LevelName(n), false, false, false); err != nil {
			return fmt.Errorf("cascade: deleting queue %q: %w", c.LevelName(n), err)
		}
	}
	for n := 0; n < c.Levels; n++ {
		if err := ch.ExchangeDelete(c.LevelName(n), false, false); err != nil {
			return fmt.Errorf("cascade: deleting exchange %q: %w", c.LevelName(n), err)
		}
	}
	if err := ch.ExchangeDelete(c.DeliveryExchange(), false, false); err != nil {
		return fmt.Errorf("cascade: deleting exchange %q: %w", c.DeliveryExchange(), err)
	}
	if err := ch.ExchangeDelete(c.settingsExchange(), false, false); err != nil {
		return fmt.Errorf("cascade: deleting exchange %q: %w", c.settingsExchange(), err)
	}
	return nil
}

// legacyLevelQueue reports whether err is the broker refusing a level
// queue's x-delivery-limit because the queue was declared without one (by
// an earlier version of this package).
func legacyLevelQueue(err error) bool {
	var de *amqpretry.DeclareError
	return errors.As(err, &de) && de.Kind == "queue" && de.Argument == "x-delivery-limit" && de.Found == "none"
}

// declareError wraps a refused declare or bind in amqpretry's DeclareError,
// as amqpretry does.
func declareError(kind, name string, err error) error {
	de := &amqpretry.DeclareError{Kind: kind, Name: name, Err: err}
	de.Argument, de.Wanted, de.Found = amqperr.Inequivalent(err)
	return de
}
