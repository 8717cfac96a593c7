package amqpwire

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Metadata keys under which Marshaler.Unmarshal keeps the AMQP message
// properties of a delivery ("AMQP 0-9-1 Model Explained", message
// attributes), and from which Marshal restores them, so that a retry or
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
// Marshaler.Unmarshal gives the handler each such header as a readable
// string under its own name (see HeaderString) and records its typed value
// here; Marshal publishes the typed value again, unless the handler changed
// or deleted the string (then its string wins, or the header is gone).
//
// The key never travels on the wire: Marshal removes it, and Unmarshal
// ignores a header of that name (it is rebuilt from the headers themselves).
// Broker headers (x-death, x-delivery-count, x-first-death-*,
// x-last-death-*), the library's own keys (prefix "rabbitretry-"),
// Watermill's *_poisoned keys and the message UUID header are never recorded
// here: they are always strings on a copy.
const TypedHeadersKey = "rabbitretry-amqp-typed-headers"

type stringProp struct {
	key string
	get func(*amqp.Delivery) string
	set func(*amqp.Publishing, string)
}

var stringProps = []stringProp{
	{PropContentTypeKey, func(d *amqp.Delivery) string { return d.ContentType }, func(p *amqp.Publishing, v string) { p.ContentType = v }},
	{PropContentEncodingKey, func(d *amqp.Delivery) string { return d.ContentEncoding }, func(p *amqp.Publishing, v string) { p.ContentEncoding = v }},
	{PropCorrelationIDKey, func(d *amqp.Delivery) string { return d.CorrelationId }, func(p *amqp.Publishing, v string) { p.CorrelationId = v }},
	{PropReplyToKey, func(d *amqp.Delivery) string { return d.ReplyTo }, func(p *amqp.Publishing, v string) { p.ReplyTo = v }},
	{PropMessageIDKey, func(d *amqp.Delivery) string { return d.MessageId }, func(p *amqp.Publishing, v string) { p.MessageId = v }},
	{PropTypeKey, func(d *amqp.Delivery) string { return d.Type }, func(p *amqp.Publishing, v string) { p.Type = v }},
	{PropAppIDKey, func(d *amqp.Delivery) string { return d.AppId }, func(p *amqp.Publishing, v string) { p.AppId = v }},
}

// PropertiesToMetadata records d's properties in md (only those set).
func PropertiesToMetadata(d *amqp.Delivery, md message.Metadata) {
	for _, p := range stringProps {
		if v := p.get(d); v != "" {
			md[p.key] = v
		}
	}
	if d.Priority != 0 {
		md[PropPriorityKey] = strconv.Itoa(int(d.Priority))
	}
	if !d.Timestamp.IsZero() {
		md[PropTimestampKey] = d.Timestamp.UTC().Format(time.RFC3339)
	}
	if d.DeliveryMode != 0 {
		md[PropDeliveryModeKey] = strconv.Itoa(int(d.DeliveryMode))
	}
}

// MetadataToProperties restores the properties recorded in msg's metadata
// onto p and removes their keys from p's headers. Malformed priority,
// timestamp or delivery-mode values (or a delivery mode of 0) are left out.
func MetadataToProperties(md message.Metadata, p *amqp.Publishing) {
	for _, sp := range stringProps {
		if v, ok := md[sp.key]; ok {
			sp.set(p, v)
			delete(p.Headers, sp.key)
		}
	}
	if v, ok := md[PropPriorityKey]; ok {
		if n, err := strconv.ParseUint(v, 10, 8); err == nil {
			p.Priority = uint8(n)
		}
		delete(p.Headers, PropPriorityKey)
	}
	if v, ok := md[PropTimestampKey]; ok {
		if ts, err := time.Parse(time.RFC3339, v); err == nil {
			p.Timestamp = ts
		}
		delete(p.Headers, PropTimestampKey)
	}
	if v, ok := md[PropDeliveryModeKey]; ok {
		if n, err := strconv.ParseUint(v, 10, 8); err == nil && n != 0 {
			p.DeliveryMode = uint8(n)
		}
		delete(p.Headers, PropDeliveryModeKey)
	}
}
