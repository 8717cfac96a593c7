package retrymeta

// The AMQP-specific keys the amqpretry Marshaler writes into metadata and
// package amqpwire reads and writes (moved here from package middleware:
// only the library's own AMQP code reads them).

// Metadata keys under which the amqpretry Marshaler (wire.PropertiesToMetadata) keeps the AMQP message
// properties of a delivery ("AMQP 0-9-1 Model Explained", message
// attributes), and from which it restores them, so that a retry or
// poison copy keeps them. watermill-amqp's DefaultMarshaler alone drops every
// property and makes every publishing persistent. Expiration (a per-message
// TTL would cut the wait in a wait queue short) and user-id (the broker checks
// it against the publishing connection's user, "Validated User-ID") are
// deliberately not carried. A key is only set when the delivery had the
// property.
const (
	PropContentTypeKey     = "rabbitretry-amqp-content-type"
	PropContentEncodingKey = "rabbitretry-amqp-content-encoding"
	PropCorrelationIDKey   = "rabbitretry-amqp-correlation-id"
	PropReplyToKey         = "rabbitretry-amqp-reply-to"
	PropMessageIDKey       = "rabbitretry-amqp-message-id"
	PropTypeKey            = "rabbitretry-amqp-type"
	PropAppIDKey           = "rabbitretry-amqp-app-id"
	// PropPriorityKey holds the priority as a decimal 0-255.
	PropPriorityKey = "rabbitretry-amqp-priority"
	// PropTimestampKey holds the timestamp as RFC 3339 (UTC, seconds).
	PropTimestampKey = "rabbitretry-amqp-timestamp"
	// PropDeliveryModeKey holds the delivery mode as a decimal: "1"
	// (transient) or "2" (persistent) ("Publishers", message durability).
	// Marshal publishes the copy with that mode, so a transient message stays
	// transient on its retry and poison copies. A delivery without a delivery
	// mode (0: the producer did not set it) records nothing, and its copies
	// get Inner's mode: persistent with watermill-amqp's DefaultMarshaler.
	PropDeliveryModeKey = "rabbitretry-amqp-delivery-mode"
)

// TypedHeadersKey holds, in metadata only, the user headers of the delivery
// whose value is not a string (integers of every width, booleans, floats,
// decimals, timestamps, byte arrays, tables, arrays, void), with their AMQP
// types: the AMQP 0-9-1 field-table encoding of those headers (the encoding
// headers have on the wire, "AMQP 0-9-1 Reference", field tables), in
// standard base64. Watermill metadata holds strings only, so
// the amqpretry Marshaler gives the handler each such header as a readable
// string under its own name (see wire.HeaderString) and records its typed value
// here; its Marshal publishes the typed value again, unless the handler changed
// or deleted the string (then its string wins, or the header is gone).
//
// The key never travels on the wire: the Marshaler removes it, and Unmarshal
// ignores a header of that name (it is rebuilt from the headers themselves).
// Broker headers (x-death, x-delivery-count, x-first-death-*,
// x-last-death-*), the library's own keys (prefix "rabbitretry-"),
// Watermill's *_poisoned keys and the message UUID header are never recorded
// here: they are always strings on a copy.
const TypedHeadersKey = "rabbitretry-amqp-typed-headers"

// DroppedHeadersKey lists, comma-separated, the user headers the poison
// publisher removed so that a poisoned copy fits amqpwire.MaxCopyHeaderBytes.
const DroppedHeadersKey = "rabbitretry-dropped-headers"
