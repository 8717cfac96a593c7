package middleware

import (
	"fmt"
)

// ErrNativeRetry is returned (possibly wrapped) by a Delayer that leaves the
// retry to the queue's own delayed retry (RabbitMQ 4.3+ quorum queues,
// x-delayed-retry-type "all"): the subscriber's nack with requeue puts the
// message into the queue's delayed state, and the queue delivers it again
// once the delay ends. It wraps ErrDeadLetter, so the republisher returns a
// *DeadLetterRetryError (with Native set) that the poison forwarder and the
// router's fallback pass through: the nack that follows is the retry.
//
// Like the dead-letter hop, a native retry publishes no copy, so it records
// no failure metadata: the next delivery is the original message as the
// producer sent it (plus the broker's x-acquired-count).
var ErrNativeRetry = fmt.Errorf("%w (native delayed retry: the queue holds the nacked original)", ErrDeadLetter)
