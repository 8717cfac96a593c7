package retrymeta

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// Metadata keys written and read by this library, and the broker's headers
// it reads: the broker-agnostic ones are all here, each defined once (the
// poison copy's marks included; the others of Watermill's PoisonQueue are
// Watermill's own), with the predicates that say which are retry state
// (IsRetryState) and which describe one delivery (IsDeliveryOnly); the
// AMQP-specific ones (message properties, typed headers, dropped headers)
// are in amqpkeys.go, the publish id in package confirm, the delay
// cascade's in amqpretry/cascade. None of the
// library's starts with "x-":
// RabbitMQ treats "x-" headers as its own, and RabbitMQ 4.x no longer
// interprets x-death on messages a client republishes ("Dead Letter
// Exchanges"), so the library keeps its own attempt count.
const (
	// AttemptKey holds the attempt number of the delivery, as a decimal
	// string: 1 on the first delivery. The delayed republisher writes
	// attempt+1 into the copy it schedules; the attempt counter reads it.
	AttemptKey = "rabbitretry-attempt"

	// ProvenAttemptKey holds the attempt number of the delivery counting only
	// evidence proven by runs of the handler (AttemptSource.Proven), as a
	// decimal string, never above AttemptKey: it is lower when the attempt
	// number includes returns that may not have run the handler (RabbitMQ
	// 4.3's x-acquired-count of a held message nacked at shutdown). The
	// attempt counter writes it with AttemptKey; the library's copies carry
	// it (the republisher writes proven+1 after a failed run). A copy
	// without it counts all of AttemptKey as proven.
	ProvenAttemptKey = "rabbitretry-proven-attempt"

	// FirstFailureKey holds the time of the first failed attempt
	// (RFC 3339 with nanoseconds, UTC). Written once, by the republisher.
	FirstFailureKey = "rabbitretry-first-failure"

	// LastFailureKey holds the time of the latest failed attempt
	// (RFC 3339 with nanoseconds, UTC).
	LastFailureKey = "rabbitretry-last-failure"

	// LastErrorKey holds the (truncated) text of the latest handler error.
	LastErrorKey = "rabbitretry-last-error"

	// ErrorClassKey holds the class the error classifier gave the latest
	// error, e.g. "transient", "permanent", "malformed", "retry-after".
	ErrorClassKey = "rabbitretry-error-class"

	// DelayKey holds the delay, in milliseconds, chosen for the retry that
	// produced this delivery.
	DelayKey = "rabbitretry-delay-ms"

	// OriginalExchangeKey, OriginalRoutingKeyKey and OriginalQueueKey record
	// where the message was first consumed from, before any retry; the poison
	// tools replay a message to OriginalQueueKey. RecordFailure writes them
	// on every retry and poison copy: OriginalQueueKey is always the queue
	// the message was consumed from (whatever the message carried), and the
	// exchange and routing key come from the delivery keys below unless the
	// delivery came back through the library's own retry path
	// (DeliveryRetryPathKey), whose values, written by the library on an
	// earlier failure, are kept. A producer cannot set them.
	OriginalExchangeKey   = "rabbitretry-original-exchange"
	OriginalRoutingKeyKey = "rabbitretry-original-routing-key"
	OriginalQueueKey      = "rabbitretry-original-queue"

	// DeliveryExchangeKey and DeliveryRoutingKeyKey describe the current
	// delivery (AMQP basic.deliver exchange and routing key). The amqpretry
	// Marshaler sets them on every Unmarshal and strips them on Marshal; they
	// never travel on the wire.
	DeliveryExchangeKey   = "rabbitretry-delivery-exchange"
	DeliveryRoutingKeyKey = "rabbitretry-delivery-routing-key"

	// DeliveryRedeliveredKey is "true" when the broker set the AMQP
	// redelivered flag on the current delivery: an earlier delivery of this
	// message was returned without an ack (consumer crash, connection or
	// channel closed, consumer_timeout, nack with requeue). Set by the
	// amqpretry Marshaler from basic.deliver, never taken from a header, and
	// never travels on the wire. Read by the RedeliveryGuard.
	DeliveryRedeliveredKey = "rabbitretry-delivery-redelivered"

	// DeliveryRetryPathKey is "true" when the current delivery came back to
	// its queue through the library's own retry path (a wait queue's
	// dead-lettering, a zero-delay copy or a replay from a poison queue), as
	// the Pub/Sub integration can tell from the delivery itself: the amqpretry
	// Marshaler sets it from the delivery's exchange, routing key and the
	// broker's x-death (and x-first-death-*) headers, never from a library
	// header, and it never travels on the wire. Only then does HeaderSource
	// count the AttemptKey the message carries, and RecordFailure keep the
	// OriginalExchangeKey and OriginalRoutingKeyKey (written by the library
	// on an earlier failure); otherwise they may be a producer's: the
	// attempt count starts at 1 and the origin keys are replaced.
	DeliveryRetryPathKey = "rabbitretry-delivery-retry-path"

	// DeliveryRetryRouteKey is "true" when the current delivery reached its
	// queue through one of the library's retry routes (the loop-back
	// exchange, a wait queue's dead-lettering back to the queue, a
	// Config.DelayerFactory's delivery), whether or not the message was
	// dead-lettered out of the queue since the library last published it
	// (DeliveryRetryPathKey additionally requires that it was not). Only on
	// such a delivery does XDeathSource count the queue's own x-death
	// entries: a DeadLetterFirstRetry or delivery-limit dead-lettering comes
	// back this way, a producer's message does not, so an x-death count a
	// producer wrote never decides a first delivery. Set by the amqpretry
	// Marshaler from the delivery (exchange, routing key, x-death), never
	// from a header; never travels on the wire.
	DeliveryRetryRouteKey = "rabbitretry-delivery-retry-route"

	// DeliveryQuarantineKey is "true" when the current delivery came from
	// its queue's quarantine queue (see Quarantiner): consumed with prefetch
	// 1, so a redelivery there is attributable to the message itself. Set by
	// the subscriber that consumes the quarantine (amqpretry's
	// Retry.NewSubscriber), never taken from a header, and never travels on
	// the wire. Read by the RedeliveryGuard.
	DeliveryQuarantineKey = "rabbitretry-delivery-quarantine"

	// RedeliveriesKey holds, as a decimal string, how many times the message
	// came back redelivered (see DeliveryRedeliveredKey) since it was first
	// consumed: the RedeliveryGuard writes it into the copy it makes of a
	// redelivered message. A redelivery does not consume an attempt; at
	// RedeliveryGuardConfig.MaxRedeliveries, on a redelivery attributable to
	// the message, it is poisoned (class ClassRedeliveryLimit).
	RedeliveriesKey = "rabbitretry-redeliveries"

	// RemainingDelayKey holds, as a decimal number of milliseconds, the part
	// of a retry's delay that the Delayer could not hold on this hop: a
	// RetryAfter or a backoff delay longer than amqpretry's longest
	// wait-queue tier, or than the delay cascade's MaxDelay. A Delayer
	// writes it on the copy it schedules (SetRemainingDelay); CloneMessage
	// leaves it off every new copy. A delivery that came back through the
	// library's own retry path (DeliveryRetryPathKey) carrying a positive
	// value is not run: the RedeliveryGuard sends a copy back through the
	// Delayer for that remaining time (confirmed, then ack), with the same
	// attempt number and redelivery count, so the next attempt never runs
	// earlier than asked. The value is a duration, not a due time, so no
	// clock is compared across processes: each hop's wait is timed by the
	// broker (the wait queue's TTL), and the total is the asked delay plus
	// the time spent in queues between hops. Retry state (IsRetryState).
	RemainingDelayKey = "rabbitretry-remaining-delay-ms"

	// XDeathKey holds the broker's x-death header, converted by the
	// amqpretry Marshaler to JSON (an array of objects with queue, reason,
	// count, exchange, routing-keys, time). Stripped on Marshal.
	XDeathKey = "x-death"

	// XDeliveryCountKey holds the quorum-queue x-delivery-count header as a
	// decimal string. Stripped on Marshal.
	XDeliveryCountKey = "x-delivery-count"

	// XAcquiredCountKey holds RabbitMQ's x-acquired-count header (quorum
	// queues, 4.x) as a decimal string: the number of times the queue gave
	// the message to a consumer and got it back without an ack, whatever the
	// return (nack, reject, channel or connection loss, consumer crash,
	// consumer timeout). It describes one delivery and never travels on a
	// copy (StripDeliveryMetadata).
	XAcquiredCountKey = "x-acquired-count"

	// XFirstDeathPrefix and XLastDeathPrefix start the broker's summary
	// headers of the first and (since RabbitMQ 3.13) latest dead-lettering:
	// x-first-death-queue, -reason, -exchange and x-last-death-queue,
	// -reason, -exchange ("Dead Letter Exchanges"). Strings; they pass
	// through Unmarshal as metadata and never travel on a copy.
	XFirstDeathPrefix = "x-first-death-"
	XLastDeathPrefix  = "x-last-death-"

	// HeaderErrorKey holds a description of header values the library
	// ignored because they were malformed (non-numeric, negative, or not
	// decodable). It is informational; it is stripped from republished copies.
	HeaderErrorKey = "rabbitretry-header-error"

	// ReplayedKey is set by the poison tools on a message replayed from a
	// poison queue: the RFC 3339 time of the replay.
	ReplayedKey = "rabbitretry-replayed"

	// PoisonReasonKey, PoisonTopicKey, PoisonHandlerKey and
	// PoisonSubscriberKey are Watermill's own poison keys
	// (message/router/middleware.PoisonQueue: "reason_poisoned",
	// "topic_poisoned", "handler_poisoned", "subscriber_poisoned"), written
	// by the PoisonForwarder so that tools built for Watermill's poison
	// queue read ours too. PoisonReasonKey holds the (truncated) error text.
	PoisonReasonKey     = wmw.ReasonForPoisonedKey
	PoisonTopicKey      = wmw.PoisonedTopicKey
	PoisonHandlerKey    = wmw.PoisonedHandlerKey
	PoisonSubscriberKey = wmw.PoisonedSubscriberKey

	// PoisonAttemptsKey holds, on a poisoned message, how many attempts were
	// made (decimal). Written by the PoisonForwarder, which leaves AttemptKey
	// and ProvenAttemptKey off the poison copy: this is its one attempt count.
	PoisonAttemptsKey = "rabbitretry-attempts"

	// PoisonedAtKey holds, on a poisoned message, the RFC 3339 time (with
	// nanoseconds, UTC) it was poisoned. Written by the poison forwarder.
	PoisonedAtKey = "rabbitretry-poisoned-at"

	// TracePrevKey carries, on every retry and poison copy, the W3C traceparent
	// of the attempt that made the copy: the next attempt's span links to it.
	TracePrevKey = "rabbitretry-trace-prev"
)

// IsDeliveryOnly reports whether the metadata key (or AMQP header) k
// describes one delivery and so must never travel on a copy the library
// publishes (retry copy, RedeliveryGuard copy, fallback copy, poison copy,
// replay, resend):
//   - the broker's x-death, x-delivery-count, x-acquired-count and every
//     x-first-death-* and x-last-death-* header. On RabbitMQ 3.13 a
//     republished copy that still carries x-death can be dropped by
//     dead-letter cycle detection; RabbitMQ 4.x ignores a client-set x-death
//     ("Dead Letter Exchanges"); x-delivery-count and x-acquired-count count
//     the returns of the consumed delivery, not of the copy ("Quorum Queues",
//     poison message handling);
//   - DeliveryExchangeKey, DeliveryRoutingKeyKey, DeliveryRedeliveredKey,
//     DeliveryRetryPathKey and DeliveryRetryRouteKey, set from basic.deliver
//     by the amqpretry Marshaler, and DeliveryQuarantineKey, set by the
//     quarantine's subscriber;
//   - HeaderErrorKey, the description of this delivery's malformed headers.
//
// StripDeliveryMetadata deletes these keys; the amqpretry Marshaler drops
// them from every publishing.
func IsDeliveryOnly(k string) bool {
	switch k {
	case XDeathKey, XDeliveryCountKey, XAcquiredCountKey,
		DeliveryExchangeKey, DeliveryRoutingKeyKey, DeliveryRedeliveredKey, DeliveryRetryPathKey,
		DeliveryRetryRouteKey, DeliveryQuarantineKey, HeaderErrorKey:
		return true
	}
	return strings.HasPrefix(k, XFirstDeathPrefix) || strings.HasPrefix(k, XLastDeathPrefix)
}

// IsRetryState reports whether the metadata key (or AMQP header) k carries
// retry state: anything by which the retry chain (AttemptCounter,
// RedeliveryGuard, Republisher) or the broker counts, or marks, earlier
// runs of the message. A message replayed from a poison queue
// (poison/admin.Admin.Replay, poisonctl replay) or resent from the audit
// (audit.Resender) is published without every such key, so it starts a fresh
// set of attempts: attempt 1 of MaxAttempts, with the whole MaxRedeliveries
// allowance. The keys:
//   - every IsDeliveryOnly key (the broker's x-death, x-delivery-count,
//     x-acquired-count, x-first-death-*, x-last-death-*; the delivery's
//     exchange, routing key, redelivered flag and retry path; HeaderErrorKey);
//   - the chain's counters: AttemptKey, ProvenAttemptKey, RedeliveriesKey
//     and DelayKey, and
//     RemainingDelayKey (the part of a delay still owed);
//   - the poison marks: PoisonAttemptsKey, PoisonedAtKey and Watermill's
//     reason_poisoned, topic_poisoned, handler_poisoned and
//     subscriber_poisoned (message/router/middleware.PoisonQueue).
//
// The failure history (FirstFailureKey, LastFailureKey, LastErrorKey,
// ErrorClassKey) and the origin (OriginalExchangeKey, OriginalRoutingKeyKey,
// OriginalQueueKey) are not retry state: a replay keeps them.
//
// The chain's own copies (a retry, a RedeliveryGuard copy) drop only the
// IsDeliveryOnly keys (StripDeliveryMetadata) and carry the counters on.
func IsRetryState(k string) bool {
	switch k {
	case AttemptKey, ProvenAttemptKey, RedeliveriesKey, DelayKey, RemainingDelayKey,
		PoisonAttemptsKey, PoisonedAtKey,
		PoisonReasonKey, PoisonTopicKey, PoisonHandlerKey, PoisonSubscriberKey:
		return true
	}
	return IsDeliveryOnly(k)
}

// SetRemainingDelay records on md, the metadata of a copy a Delayer is
// scheduling, the part d of the asked delay it cannot hold (RemainingDelayKey,
// in whole milliseconds, rounded up so the message never comes back early);
// d <= 0 deletes the key. A Delayer that holds every delay in full (such as
// MemoryDelayer) need not call it; one with a longest delay (amqpretry's
// tiers, the delay cascade) calls it on every copy it schedules with a
// positive delay. A copy with delay 0 keeps what its maker set: the
// fallback sets it on a copy it sends straight back when the Delayer refused
// a long RetryAfter.
func SetRemainingDelay(md message.Metadata, d time.Duration) {
	if d <= 0 {
		delete(md, RemainingDelayKey)
		return
	}
	ms := (d + time.Millisecond - 1) / time.Millisecond
	md.Set(RemainingDelayKey, strconv.FormatInt(int64(ms), 10))
}

// RemainingDelay returns the part of its retry delay that msg still owes
// (RemainingDelayKey): 0 when absent, malformed or not positive, and 0
// unless the delivery came back through the library's own retry path
// (DeliveryRetryPathKey "true"), so a header a producer sets cannot delay a
// message's first run.
func RemainingDelay(msg *message.Message) time.Duration {
	if msg.Metadata.Get(DeliveryRetryPathKey) != "true" {
		return 0
	}
	n, err := strconv.ParseInt(msg.Metadata.Get(RemainingDelayKey), 10, 64)
	if err != nil || n <= 0 {
		return 0
	}
	if n > int64(math.MaxInt64/time.Millisecond) {
		n = int64(math.MaxInt64 / time.Millisecond)
	}
	return time.Duration(n) * time.Millisecond
}

// StripDeliveryMetadata deletes from md every key that describes one
// delivery (IsDeliveryOnly: x-death, x-delivery-count, x-acquired-count,
// x-first-death-*, x-last-death-*, the delivery exchange, routing key,
// redelivered flag and retry path, header errors), so that a copy does not
// carry them. On RabbitMQ 3.13 a republished copy that still carries x-death
// can be dropped by dead-letter cycle detection ("Dead Letter Exchanges").
func StripDeliveryMetadata(md message.Metadata) {
	for k := range md {
		if IsDeliveryOnly(k) {
			delete(md, k)
		}
	}
}

// DefaultLoopBackExchange is the default loop-back exchange name:
// amqpretry.Naming.LoopBackExchange and poison/admin's
// Config.LoopBackExchange default to it.
const DefaultLoopBackExchange = "rabbitretry.loopback"

// Redeliveries returns the redelivery count a message carries
// (rabbitretry-redeliveries): 0 when absent or malformed, at most 1000
// (middleware.MaxAttemptsCap).
func Redeliveries(msg *message.Message) int {
	v := msg.Metadata.Get(RedeliveriesKey)
	if v == "" {
		return 0
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return 0
	}
	return int(min(n, 1000))
}
