package amqpwire

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// The RabbitMQ attempt sources: counts the broker keeps (x-death, the quorum
// queue's x-delivery-count and x-acquired-count), read from the metadata the
// amqpretry Marshaler writes. middleware.HeaderSource, the library's own
// count, stays in middleware.

// XDeathSource counts the broker's dead-lettering of the message out of its
// originating queue, from the x-death header ("Dead Letter Exchanges") that
// the amqpretry Marshaler exposes as JSON under middleware.XDeathKey: the sum of the
// counts of entries whose queue is queue(msg) and whose reason is "rejected"
// (a nack/reject with requeue=false, e.g. when the republish failed) or
// "delivery_limit" (a quorum queue's delivery limit). Entries of other queues
// and "expired" entries of wait queues do not count. The republisher strips
// x-death from the copies it schedules, so these counts are the failures
// since the last scheduled copy, and they add to middleware.HeaderSource.
//
// They count only on a delivery that reached the queue through one of the
// library's retry routes (retrymeta.DeliveryRetryRouteKey, set by the amqpretry
// Marshaler from the delivery): a dead-lettering out of the queue comes back
// that way (DeadLetterFirstRetry, a delivery limit), while an x-death a
// producer wrote (or one copied from another message) arrives with a first
// delivery and counts 0 there. A transport without that evidence
// (gochannel) has no broker x-death: there an x-death never counts.
//
// queue returns the originating queue name; nil means the router's subscribe
// topic (message.SubscribeTopicFromCtx). Malformed JSON is an error; a count
// below 0 is an error; the sum is capped at middleware.MaxAttemptsCap.
func XDeathSource(queue func(msg *message.Message) string) middleware.AttemptSource {
	if queue == nil {
		queue = func(msg *message.Message) string { return message.SubscribeTopicFromCtx(msg.Context()) }
	}
	return middleware.AttemptSource{Name: middleware.XDeathKey, Previous: func(msg *message.Message) (int64, error) {
		if msg.Metadata.Get(retrymeta.DeliveryRetryRouteKey) != "true" {
			return 0, nil // not back through a retry route: a first delivery here
		}
		return xDeathRejections(msg, queue)
	}}
}

// xDeathRejections is XDeathSource's count on a retry route; out of line
// so that the common path stays small on the stack (the chain runs on a
// fresh goroutine per message, whose stack starts at 2 KiB).
//
//go:noinline
func xDeathRejections(msg *message.Message, queue func(msg *message.Message) string) (int64, error) {
	recs, err := ParseXDeath(msg.Metadata[middleware.XDeathKey])
	if err != nil || len(recs) == 0 {
		return 0, err // the common case: never dead-lettered
	}
	q := queue(msg)
	var sum int64
	for _, r := range recs {
		if r.Queue != q || (r.Reason != "rejected" && r.Reason != "delivery_limit") {
			continue
		}
		if r.Count < 0 {
			return 0, fmt.Errorf("x-death count %d for queue %q is negative", r.Count, r.Queue)
		}
		sum += min(r.Count, middleware.MaxAttemptsCap)
		if sum >= middleware.MaxAttemptsCap {
			return middleware.MaxAttemptsCap, nil
		}
	}
	return sum, nil
}

// DeliveryCountSource reads the quorum-queue x-delivery-count header ("Quorum
// Queues": the number of earlier deliveries that were returned to the queue,
// e.g. by a consumer that crashed or a nack with requeue). It is not in the
// default sources, because a requeue is not always a failed attempt; add it
// when redeliveries should count. Non-numeric or negative: an error.
func DeliveryCountSource() middleware.AttemptSource {
	return middleware.AttemptSource{Name: retrymeta.XDeliveryCountKey, Previous: func(msg *message.Message) (int64, error) {
		v, ok := msg.Metadata[retrymeta.XDeliveryCountKey]
		if !ok {
			return 0, nil
		}
		return parseCount(retrymeta.XDeliveryCountKey, v)
	}}
}

// AcquiredCountSource counts the returns of a message to its quorum queue
// from the broker's x-acquired-count (retrymeta.XAcquiredCountKey), but only on a
// delivery with the redelivered flag (retrymeta.DeliveryRedeliveredKey): on a first
// delivery the header can only be a producer's (RabbitMQ 4.3 passes a
// forged value through until the first return, then replaces it), so it
// counts 0 there.
//
// It is the attempt source of amqpretry's native delayed retry, where each
// retry is a return (a nack with requeue), and so is every crash: a
// consumer that dies or loses its connection holding the message uses one
// attempt, and a crash loop ends in the poison queue after MaxAttempts
// (the RedeliveryGuard lets such redeliveries run, see
// middleware.RedeliveryGuardConfig.RedeliveriesCounted). The library's own copies
// (wait queue, fallback) are new messages: their count starts again at 0
// and middleware.AttemptKey carries the attempts before them, so the two add up.
//
// Its count is proven (Proven nil): in the native mode every return is
// charged as an attempt by design (a crash loop must end in the poison
// queue after MaxAttempts, which an unproven count would not bound), and
// the nacks are the native retries of failed runs. A message the Pause
// held when the router stopped is also charged there (see
// docs/attempts.md).
//
// Absent: 0. Non-numeric or negative: an error (the counter ignores it).
// Above middleware.MaxAttemptsCap: middleware.MaxAttemptsCap.
func AcquiredCountSource() middleware.AttemptSource {
	return middleware.AttemptSource{Name: retrymeta.XAcquiredCountKey, Previous: func(msg *message.Message) (int64, error) {
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
// retries (each a nack with requeue, amqpretry.NativeDelayed), plus the fallback's
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
// Its count is unproven (middleware.AttemptSource.Proven returns 0): a nack with
// requeue also hands back a delivery whose handler did not run (the
// RedeliveryGuard's or the Pause's copy refused during a broker alarm, a
// message the Pause held when the router stopped), so the Republisher does
// not poison a message without running it on this evidence alone: past
// MaxAttempts only because of it, the message runs once more as its last
// attempt (see Republisher.Middleware).
//
// Absent x-acquired-count: 0. Non-numeric or negative values: an error (the
// counter ignores the source). Above middleware.MaxAttemptsCap: middleware.MaxAttemptsCap.
func NackCountSource() middleware.AttemptSource {
	return middleware.AttemptSource{Name: "nack-count", Previous: func(msg *message.Message) (int64, error) {
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

// parseCount parses a non-negative decimal count. Out-of-range positive
// values clamp to middleware.MaxAttemptsCap (as middleware's header count).
func parseCount(key, v string) (int64, error) {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		var ne *strconv.NumError
		if errors.As(err, &ne) && errors.Is(ne.Err, strconv.ErrRange) && len(v) > 0 && v[0] != '-' {
			return middleware.MaxAttemptsCap, nil
		}
		return 0, fmt.Errorf("%s=%.40q is not a decimal number", key, v)
	}
	if n < 0 {
		return 0, fmt.Errorf("%s=%d is negative", key, n)
	}
	if n > middleware.MaxAttemptsCap {
		return middleware.MaxAttemptsCap, nil
	}
	return n, nil
}

// Sources returns the attempt sources amqpretry.New gives the chain, one
// counting rule for every retry mode so that a deploy that switches modes
// keeps the count: this queue's own evidence, i.e. its chain's attempt
// header (middleware.HeaderSource), its own x-death rejections
// (XDeathSource) and the returns the broker counted (NackCountSource, or
// AcquiredCountSource when redeliveriesCounted, as in the native delayed
// retry, where every redelivery, a crash too, is an attempt). queue names
// the originating queue of a message; nil means the router's subscribe
// topic.
func Sources(queue func(msg *message.Message) string, redeliveriesCounted bool) []middleware.AttemptSource {
	returns := NackCountSource()
	if redeliveriesCounted {
		returns = AcquiredCountSource()
	}
	return []middleware.AttemptSource{middleware.HeaderSource(queue), XDeathSource(queue), returns}
}
