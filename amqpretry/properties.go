package amqpretry

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Metadata keys under which Marshaler.Unmarshal keeps the AMQP message
// properties of a delivery, and from which Marshal restores them, so that a
// retry or poison copy keeps them. watermill-amqp's DefaultMarshaler alone
// drops every property but the delivery mode. Expiration (a per-message TTL
// would cut the wait in a wait queue short) and user-id (the broker checks it
// against the publishing connection's user) are deliberately not carried.
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
)

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

// propertiesToMetadata records d's properties in md (only those set).
func propertiesToMetadata(d *amqp.Delivery, md message.Metadata) {
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
}

// metadataToProperties restores the properties recorded in msg's metadata
// onto p and removes their keys from p's headers. Malformed priority or
// timestamp values are left out.
func metadataToProperties(md message.Metadata, p *amqp.Publishing) {
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
}
