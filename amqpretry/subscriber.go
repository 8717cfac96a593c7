package amqpretry

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/router"
)

// NewSubscriber returns a watermill-amqp subscriber on SubscriberConfig,
// wrapped in a router.DrainingSubscriber so that stopping the router (by
// cancelling the context of message.Router.Run, or by Router.Close) lets
// in-flight handlers finish (and their messages be acked, retried or
// poisoned) before the subscriber closes, instead of watermill-amqp's nack
// of every in-flight delivery; an idle router stops at once. drainTimeout
// bounds that wait (0: 20 s); keep it below the router's CloseTimeout
// (Watermill's default 30 s). Once Run's context has ended the subscriber
// closes itself; Close it anyway (it returns the drain's result). It returns
// watermill-amqp's error.
//
// Unless Config.DisableCrashQuarantine, each subscription also consumes
// the originating queue's quarantine queue (Naming.QuarantineQueue) on a
// second connection (its connection_name, if set, gets ".quarantine"
// appended), and hands its messages to the same handler: the
// RedeliveryGuard moves a redelivered message there so that a crash is
// counted against the message that crashed, not against the others the
// consumer held (see middleware.RedeliveryGuard). Quarantine messages are
// fetched one at a time (basic.get), only while no message of the
// originating queue is in flight, at once when this process moved one there
// and otherwise every second; so the client never holds one
// it has not started. One that is fetched but not run (the router stopped
// first) or that the router nacks is handed back: republished unchanged
// (same attempt and redelivery count, confirmed), then acked, so that a
// stop is not counted as its redelivery. A subscriber built from
// SubscriberConfig alone does not consume the quarantine; the guard then
// counts every redelivery in the originating queue.
func (r *Retry) NewSubscriber(logger watermill.LoggerAdapter, drainTimeout time.Duration) (*router.DrainingSubscriber, error) {
	if r.noQuarantine {
		sub, err := wamqp.NewSubscriber(r.subscriber, logger)
		if err != nil {
			return nil, err
		}
		return router.NewDrainingSubscriber(sub, drainTimeout), nil
	}
	sub, err := newQuarantineSubscriber(r.subscriber, r.topology, r.handBack, logger)
	if err != nil {
		return nil, err
	}
	return router.NewDrainingSubscriber(sub, drainTimeout), nil
}

// handBack publishes msg unchanged (delivery metadata dropped by the
// Marshaler) to queue's quarantine queue through the loop-back exchange,
// confirmed.
func (r *Retry) handBack(ctx context.Context, msg *message.Message, queue string) error {
	return r.delayer.publish(ctx, msg, r.topology.naming.LoopBackExchange, r.topology.naming.QuarantineQueue(queue), queue)
}
