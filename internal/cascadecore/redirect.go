package cascadecore

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// errSameQueue is returned by Redirect and Unredirect when from and to are
// the same queue.
var errSameQueue = errors.New("cascade: redirecting a queue to itself")

// Redirect makes messages addressed to from arrive at to instead, without
// touching them: it binds to to the delivery exchange with from's key
// pattern ("*." × Levels + from) and then removes from's own binding
// (the reverse of BindDestination). Messages keep waiting in their level queues and
// arrive at to on time; messages published for from later do too. The
// binding is on the broker, so it holds for every publisher.
//
// When to use which, for decommissioning a queue from:
//
//   - Redirect: instant (two binding operations), whatever the number of
//     waiting messages, and nothing is taken out of the cascade. But
//     anything that binds from again (a Delayer or Publisher still
//     publishing to from, which binds each destination once per process;
//     amqpretry.New's topology builder, on every subscriber reconnect)
//     makes from's messages arrive at both queues. Stop from's services
//     first; undo with Unredirect(ch, from, to) (rebinds from, then
//     unbinds to).
//   - Census with CensusOptions.Move: rewrites each waiting message's
//     key, so it no longer depends on bindings at all; costs a take-out
//     and a confirmed publish per message in the cascade (all
//     destinations' messages are taken out and put back), and messages
//     published for from afterwards still go to from.
//
// Both queues must exist. It returns Validate's error, ErrBadQueueName
// (wrapped), errSameQueue, or an *amqpretry.DeclareError (Kind "binding";
// 404 NOT_FOUND for a missing queue, which closes ch). If the unbind
// fails, to is already bound: messages then reach both queues.
func (c Config) Redirect(ch *amqp.Channel, from, to string) error {
	return c.moveBinding(ch, from, to, to, from)
}

// Unredirect undoes Redirect(from, to): it binds from again with its own
// key pattern ("*." × Levels + from, BindDestination) and then removes
// to's binding of that pattern, so from's waiting messages arrive at from
// again, on time. In that order: between the two operations a message
// leaving level 0 reaches both queues (a duplicate, at worst); the reverse
// order would leave from's messages unroutable meanwhile, and quorum level
// queues would hold them for the dead-letter worker's resend interval
// (minutes late; see the package doc). to's own binding (its own key
// pattern) is untouched. Both queues must exist.
//
// It returns Validate's error, ErrBadQueueName (wrapped), errSameQueue, or
// an *amqpretry.DeclareError (Kind "binding"; 404 NOT_FOUND for a missing
// queue, which closes ch). If the unbind fails, from is already bound
// again: messages then reach both queues until it is retried.
func (c Config) Unredirect(ch *amqp.Channel, from, to string) error {
	return c.moveBinding(ch, from, to, from, to)
}

// moveBinding checks from and to, then binds bind and unbinds unbind with
// from's delivery pattern, in that order (Redirect: to then from;
// Unredirect: from then to).
func (c Config) moveBinding(ch *amqp.Channel, from, to, bind, unbind string) error {
	c, err := c.resolved()
	if err != nil {
		return err
	}
	if err := c.checkQueue(from); err != nil {
		return err
	}
	if err := c.checkQueue(to); err != nil {
		return err
	}
	if from == to {
		return fmt.Errorf("%w: %q", errSameQueue, from)
	}
	if err := ch.QueueBind(bind, c.destinationPattern(from), c.DeliveryExchange(), false, nil); err != nil {
		return declareError("binding", bind, err)
	}
	if err := ch.QueueUnbind(unbind, c.destinationPattern(from), c.DeliveryExchange(), nil); err != nil {
		return declareError("binding", unbind, err)
	}
	return nil
}
