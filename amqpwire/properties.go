package amqpwire

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/middleware"
)

type stringProp struct {
	key string
	get func(*amqp.Delivery) string
	set func(*amqp.Publishing, string)
}

var stringProps = []stringProp{
	{middleware.PropContentTypeKey, func(d *amqp.Delivery) string { return d.ContentType }, func(p *amqp.Publishing, v string) { p.ContentType = v }},
	{middleware.PropContentEncodingKey, func(d *amqp.Delivery) string { return d.ContentEncoding }, func(p *amqp.Publishing, v string) { p.ContentEncoding = v }},
	{middleware.PropCorrelationIDKey, func(d *amqp.Delivery) string { return d.CorrelationId }, func(p *amqp.Publishing, v string) { p.CorrelationId = v }},
	{middleware.PropReplyToKey, func(d *amqp.Delivery) string { return d.ReplyTo }, func(p *amqp.Publishing, v string) { p.ReplyTo = v }},
	{middleware.PropMessageIDKey, func(d *amqp.Delivery) string { return d.MessageId }, func(p *amqp.Publishing, v string) { p.MessageId = v }},
	{middleware.PropTypeKey, func(d *amqp.Delivery) string { return d.Type }, func(p *amqp.Publishing, v string) { p.Type = v }},
	{middleware.PropAppIDKey, func(d *amqp.Delivery) string { return d.AppId }, func(p *amqp.Publishing, v string) { p.AppId = v }},
}

// PropertiesToMetadata records d's properties in md (only those set).
func PropertiesToMetadata(d *amqp.Delivery, md message.Metadata) {
	for _, p := range stringProps {
		if v := p.get(d); v != "" {
			md[p.key] = v
		}
	}
	if d.Priority != 0 {
		md[middleware.PropPriorityKey] = strconv.Itoa(int(d.Priority))
	}
	if !d.Timestamp.IsZero() {
		md[middleware.PropTimestampKey] = d.Timestamp.UTC().Format(time.RFC3339)
	}
	if d.DeliveryMode != 0 {
		md[middleware.PropDeliveryModeKey] = strconv.Itoa(int(d.DeliveryMode))
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
	if v, ok := md[middleware.PropPriorityKey]; ok {
		if n, err := strconv.ParseUint(v, 10, 8); err == nil {
			p.Priority = uint8(n)
		}
		delete(p.Headers, middleware.PropPriorityKey)
	}
	if v, ok := md[middleware.PropTimestampKey]; ok {
		if ts, err := time.Parse(time.RFC3339, v); err == nil {
			p.Timestamp = ts
		}
		delete(p.Headers, middleware.PropTimestampKey)
	}
	if v, ok := md[middleware.PropDeliveryModeKey]; ok {
		if n, err := strconv.ParseUint(v, 10, 8); err == nil && n != 0 {
			p.DeliveryMode = uint8(n)
		}
		delete(p.Headers, middleware.PropDeliveryModeKey)
	}
}
