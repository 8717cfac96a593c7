package middleware

import (
	"context"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// The metadata keys users read: on a retry copy, on a poisoned message, in
// a handler (msg.Metadata) or in the poison queue. Each is defined once, in
// the library's one vocabulary (internal/retrymeta/keys.go), and exported
// here; the keys that describe one delivery (the broker's x-delivery-count,
// x-acquired-count, x-first-death-*, the delivery exchange and routing key,
// the redelivered flag, the retry path) or carry the chain's own bookkeeping
// (the proven attempt, redeliveries, the remaining delay, the trace link)
// stay internal: nothing outside the library should read or write them.
// Why one internal file rather than all keys here: the predicates that every
// copy path uses (which keys a copy drops, which a replay drops) and the
// copy helpers of router, amqpretry, audit and poison/admin need every key,
// and they must not be public API. None of the library's keys starts with
// "x-" (RabbitMQ treats "x-" headers as its own, and RabbitMQ 4.x no longer
// interprets x-death on messages a client republishes, "Dead Letter
// Exchanges"), so the library keeps its own attempt count.
//
// A poisoned message also carries Watermill's own poison keys
// (message/router/middleware.ReasonForPoisonedKey "reason_poisoned",
// PoisonedTopicKey, PoisonedHandlerKey, PoisonedSubscriberKey), so tools
// built for Watermill's PoisonQueue read it too.
const (
	// AttemptKey holds the attempt number of the delivery, as a decimal
	// string: 1 on the first delivery. The Republisher writes attempt+1 into
	// the copy it schedules; the AttemptCounter reads it (only on a copy the
	// library published for this queue). A poisoned message carries
	// PoisonAttemptsKey instead.
	AttemptKey = retrymeta.AttemptKey

	// FirstFailureKey holds the time of the first failed attempt
	// (RFC 3339 with nanoseconds, UTC). Written once, by the Republisher.
	FirstFailureKey = retrymeta.FirstFailureKey

	// LastFailureKey holds the time of the latest failed attempt
	// (RFC 3339 with nanoseconds, UTC).
	LastFailureKey = retrymeta.LastFailureKey

	// LastErrorKey holds the (truncated) text of the latest handler error.
	LastErrorKey = retrymeta.LastErrorKey

	// ErrorClassKey holds the class the Classifier gave the latest error,
	// e.g. ClassTransient, ClassPermanent, ClassMalformed, ClassRetryAfter.
	ErrorClassKey = retrymeta.ErrorClassKey

	// DelayKey holds the delay, in milliseconds, chosen for the retry that
	// produced this delivery.
	DelayKey = retrymeta.DelayKey

	// OriginalExchangeKey, OriginalRoutingKeyKey and OriginalQueueKey record
	// where the message was first consumed from, before any retry; the poison
	// tools replay a message to OriginalQueueKey. Written on every retry and
	// poison copy: OriginalQueueKey is always the queue the message was
	// consumed from; the exchange and routing key are those of the first
	// failed delivery. A producer cannot set them.
	OriginalExchangeKey   = retrymeta.OriginalExchangeKey
	OriginalRoutingKeyKey = retrymeta.OriginalRoutingKeyKey
	OriginalQueueKey      = retrymeta.OriginalQueueKey

	// XDeathKey holds the broker's x-death header, converted by the
	// amqpretry Marshaler to JSON (an array of objects with queue, reason,
	// count, exchange, routing-keys, time). It describes one delivery and
	// never travels on a copy.
	XDeathKey = retrymeta.XDeathKey

	// ReplayedKey is set by the poison tools on a message replayed from a
	// poison queue: the RFC 3339 time of the replay.
	ReplayedKey = retrymeta.ReplayedKey

	// PoisonAttemptsKey holds, on a poisoned message, how many attempts were
	// made (decimal): the poisoned message's one attempt count (the
	// PoisonForwarder leaves AttemptKey off the poison copy).
	PoisonAttemptsKey = retrymeta.PoisonAttemptsKey

	// PoisonedAtKey holds, on a poisoned message, the RFC 3339 time (with
	// nanoseconds, UTC) it was poisoned. Written by the PoisonForwarder.
	PoisonedAtKey = retrymeta.PoisonedAtKey
)

// IsRetryState reports whether the metadata key (or AMQP header) k carries
// retry state: anything by which the retry chain or the broker counts, or
// marks, earlier runs of the message (AttemptKey, DelayKey,
// PoisonAttemptsKey, PoisonedAtKey, Watermill's *_poisoned keys, the
// broker's x-death and x-delivery-count, the chain's internal counters). A
// message replayed from a poison queue (poison/admin, poisonctl replay) or
// resent from the audit is published without every such key, so it starts a
// fresh set of attempts. The failure history (FirstFailureKey,
// LastFailureKey, LastErrorKey, ErrorClassKey) and the origin
// (OriginalExchangeKey, OriginalRoutingKeyKey, OriginalQueueKey) are not
// retry state: a replay keeps them. Use it to republish a message by hand.
func IsRetryState(k string) bool { return retrymeta.IsRetryState(k) }

// MinimumDelay returns the lower bound the Republisher set on ctx for the
// delay being scheduled, if any: a handler asked for RetryAfter(d). A
// Delayer that rounds delays (amqpretry's tiers) rounds up to it, never
// bringing the message back earlier than the handler asked.
func MinimumDelay(ctx context.Context) (time.Duration, bool) { return retrymeta.MinimumDelay(ctx) }
