package middleware

// Metadata keys written and read by this library. None starts with "x-":
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
	// where the message was first consumed from, before any retry. They are
	// set on the first failure from the delivery keys below and then kept.
	OriginalExchangeKey   = "rabbitretry-original-exchange"
	OriginalRoutingKeyKey = "rabbitretry-original-routing-key"
	OriginalQueueKey      = "rabbitretry-original-queue"

	// DeliveryExchangeKey and DeliveryRoutingKeyKey describe the current
	// delivery (AMQP basic.deliver exchange and routing key). The amqpretry
	// Marshaler sets them on every Unmarshal and strips them on Marshal; they
	// never travel on the wire.
	DeliveryExchangeKey   = "rabbitretry-delivery-exchange"
	DeliveryRoutingKeyKey = "rabbitretry-delivery-routing-key"

	// XDeathKey holds the broker's x-death header, converted by the
	// amqpretry Marshaler to JSON (an array of objects with queue, reason,
	// count, exchange, routing-keys, time). Stripped on Marshal.
	XDeathKey = "x-death"

	// XDeliveryCountKey holds the quorum-queue x-delivery-count header as a
	// decimal string. Stripped on Marshal.
	XDeliveryCountKey = "x-delivery-count"

	// ReplayedKey is set by the poison tools on a message replayed from a
	// poison queue: the RFC 3339 time of the replay.
	ReplayedKey = "rabbitretry-replayed"
)
