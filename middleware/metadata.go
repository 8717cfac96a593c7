package middleware

// Metadata keys written and read by this library: the broker-agnostic ones
// are all here; the AMQP-specific ones (message properties, typed headers,
// dropped headers) are in package amqpretry (properties.go, framesize.go),
// and the poison copy's own in package poison (forwarder.go, with
// Watermill's PoisonQueue keys). None starts with "x-":
// RabbitMQ treats "x-" headers as its own, and RabbitMQ 4.x no longer
// interprets x-death on messages a client republishes ("Dead Letter
// Exchanges"), so the library keeps its own attempt count.
const (
	// AttemptKey holds the attempt number of the delivery, as a decimal
	// string: 1 on the first delivery. The delayed republisher writes
	// attempt+1 into the copy it schedules; the attempt counter reads it.
	AttemptKey = "rabbitretry-attempt"

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
	// Marshaler sets it from the delivery's exchange and its latest x-death
	// entry, never from a header, and it never travels on the wire. Only then
	// does RecordFailure keep the OriginalExchangeKey and
	// OriginalRoutingKeyKey the message carries (written by the library on an
	// earlier failure); otherwise they may be a producer's and are replaced.
	DeliveryRetryPathKey = "rabbitretry-delivery-retry-path"

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

	// XDeathKey holds the broker's x-death header, converted by the
	// amqpretry Marshaler to JSON (an array of objects with queue, reason,
	// count, exchange, routing-keys, time). Stripped on Marshal.
	XDeathKey = "x-death"

	// XDeliveryCountKey holds the quorum-queue x-delivery-count header as a
	// decimal string. Stripped on Marshal.
	XDeliveryCountKey = "x-delivery-count"

	// HeaderErrorKey holds a description of header values the library
	// ignored because they were malformed (non-numeric, negative, or not
	// decodable). It is informational; it is stripped from republished copies.
	HeaderErrorKey = "rabbitretry-header-error"

	// ReplayedKey is set by the poison tools on a message replayed from a
	// poison queue: the RFC 3339 time of the replay.
	ReplayedKey = "rabbitretry-replayed"
)
