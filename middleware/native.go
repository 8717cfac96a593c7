package middleware

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
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

// AcquiredCountSource counts the returns of a message to its quorum queue
// from the broker's x-acquired-count (XAcquiredCountKey), but only on a
// delivery with the redelivered flag (DeliveryRedeliveredKey): on a first
// delivery the header can only be a producer's (RabbitMQ 4.3 passes a
// forged value through until the first return, then replaces it), so it
// counts 0 there.
//
// It is the attempt source of amqpretry's native delayed retry, where each
// retry is a return (a nack with requeue), and so is every crash: a
// consumer that dies or loses its connection holding the message uses one
// attempt, and a crash loop ends in the poison queue after MaxAttempts
// (the RedeliveryGuard lets such redeliveries run, see
// RedeliveryGuardConfig.RedeliveriesCounted). The library's own copies
// (wait queue, fallback) are new messages: their count starts again at 0
// and AttemptKey carries the attempts before them, so the two add up.
//
// Its count is proven (Proven nil): in the native mode every return is
// charged as an attempt by design (a crash loop must end in the poison
// queue after MaxAttempts, which an unproven count would not bound), and
// the nacks are the native retries of failed runs. A message the Pause
// held when the router stopped is also charged there (see
// docs/attempts.md).
//
// Absent: 0. Non-numeric or negative: an error (the counter ignores it).
// Above MaxAttemptsCap: MaxAttemptsCap.
func AcquiredCountSource() AttemptSource {
	return AttemptSource{Name: retrymeta.XAcquiredCountKey, Previous: func(msg *message.Message) (int64, error) {
		if msg.Metadata.Get(retrymeta.DeliveryRedeliveredKey) == "" {
			return 0, nil
		}
		v, ok := msg.Metadata[retrymeta.XAcquiredCountKey]
		if !ok {
			return 0, nil
		}
		return parseCount(retrymeta.XAcquiredCountKey, v)
	}}
}

// NackCountSource counts the returns of a message to its quorum queue that
// were nacks (basic.nack with requeue) rather than failures: x-acquired-count
// minus x-delivery-count, on a delivery with the redelivered flag only (on a
// first delivery both headers can only be a producer's). RabbitMQ 4.3's
// quorum queue docs ("When is delivery count incremented?"): basic.nack
// raises x-acquired-count only; basic.reject, a client crash or a connection
// loss raise both. So the difference is the library's native delayed
// retries (each a nack with requeue, see ErrNativeRetry), plus the fallback's
// requeue of a failure it could not settle and a consumer timeout, also
// counted as attempts; crashes and connection losses are not (the
// RedeliveryGuard counts those, as redeliveries).
//
// It is in the default sources of every retry mode, so that a switch from
// amqpretry's native delayed retry to wait queues, the delay cascade or
// DeadLetterFirstRetry keeps the attempts already made: the first delivery
// after the deploy is a redelivery carrying them. (In the native mode
// itself AcquiredCountSource, which also counts crashes, replaces it.) On
// brokers without x-acquired-count (3.x) and on classic queues it counts 0.
//
// Its count is unproven (AttemptSource.Proven returns 0): a nack with
// requeue also hands back a delivery whose handler did not run (the
// RedeliveryGuard's or the Pause's copy refused during a broker alarm, a
// message the Pause held when the router stopped), so the Republisher does
// not poison a message without running it on this evidence alone: past
// MaxAttempts only because of it, the message runs once more as its last
// attempt (see Republisher.Middleware).
//
// Absent x-acquired-count: 0. Non-numeric or negative values: an error (the
// counter ignores the source). Above MaxAttemptsCap: MaxAttemptsCap.
func NackCountSource() AttemptSource {
	return AttemptSource{Name: "nack-count", Previous: func(msg *message.Message) (int64, error) {
		if msg.Metadata.Get(retrymeta.DeliveryRedeliveredKey) == "" {
			return 0, nil
		}
		v, ok := msg.Metadata[retrymeta.XAcquiredCountKey]
		if !ok {
			return 0, nil
		}
		acquired, err := parseCount(retrymeta.XAcquiredCountKey, v)
		if err != nil {
			return 0, err
		}
		var failures int64
		if d, ok := msg.Metadata[retrymeta.XDeliveryCountKey]; ok {
			if failures, err = parseCount(retrymeta.XDeliveryCountKey, d); err != nil {
				return 0, err
			}
		}
		return max(acquired-failures, 0), nil
	}, Proven: func(*message.Message) (int64, error) {
		// Outside the native mode a nack is not always a failed run: the
		// RedeliveryGuard's or the Pause's refused copy (broker alarm) and a
		// message the Pause held at shutdown are nacked with requeue
		// without running the handler.
		return 0, nil
	}}
}
