package retrymeta

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrNoQuarantine is returned (wrapped) by a Quarantiner that has no
// quarantine for the message's queue in this process (nothing consumes it):
// the RedeliveryGuard then counts the redelivery on a copy in the queue
// itself.
var ErrNoQuarantine = errors.New("no quarantine consumer for this queue")

// Quarantiner is implemented by a Delayer that can move a redelivered
// message to its queue's quarantine queue: a queue consumed by the same
// handler with prefetch 1, so that a redelivery there names the message
// that crashed (a crash returns every unacked delivery of the connection,
// and RabbitMQ's x-delivery-count and x-acquired-count rise for each of
// them: RabbitMQ quorum queue docs, "When is delivery count incremented?").
// amqpretry's Delayer implements it (the middleware RedeliveryGuard asserts
// it on its Delayer) when the subscriber comes from
// Retry.NewSubscriber.
type Quarantiner interface {
	// Quarantine publishes msg (a copy, delivery metadata stripped) to the
	// quarantine queue of the message's queue and returns once the broker
	// confirmed it. An error wrapping ErrNoQuarantine means nothing
	// consumes that quarantine in this process.
	Quarantine(ctx context.Context, msg *message.Message) error
}
