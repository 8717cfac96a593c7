package wire

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

type stringProp struct {
	key string
	get func(*amqp.Delivery) string
	set func(*amqp.Publishing, string)
}

var stringProps = []stringProp{
	{retrymeta.PropContentTypeKey, func(d *amqp.Delivery) string { return d.ContentType }, func(p *amqp.Publishing, v string) { p.ContentType = v }},
	{retrymeta.PropContentEncodingKey, func(d *amqp.Delivery) string { return d.ContentEncoding }, func(p *amqp.Publishing, v string) { p.ContentEncoding = v }},
	{retrymeta.PropCorrelationIDKey, func(d *amqp.Delivery) string { return d.CorrelationId }, func(p *amqp.Publishing, v string) { p.CorrelationId = v }},
	{retrymeta.PropReplyToKey, func(d *amqp.Delivery) string { return d.ReplyTo }, func(p *amqp.Publishing, v string) { p.ReplyTo = v }},
	{retrymeta.PropMessageIDKey, func(d *amqp.Delivery) string { return d.MessageId }, func(p *amqp.Publishing, v string) { p.MessageId = v }},
	{retrymeta.PropTypeKey, func(d *amqp.Delivery) string { return d.Type }, func(p *amqp.Publishing, v string) { p.Type = v }},
	{retrymeta.PropAppIDKey, func(d *amqp.Delivery) string { return d.AppId }, func(p *amqp.Publishing, v string) { p.AppId = v }},
}

// PropertiesToMetadata records d's properties in md (only those set).
func PropertiesToMetadata(d *amqp.Delivery, md message.Metadata) {
	for _, p := range stringProps {
		if v := p.get(d); v != "" {
			md[p.key] = v
		}
	}
	if d.Priority != 0 {
		md[retrymeta.PropPriorityKey] = strconv.Itoa(int(d.Priority))
	}
	if !d.Timestamp.IsZero() {
		md[retrymeta.PropTimestampKey] = d.Timestamp.UTC().Format(time.RFC3339)
	}
	if d.DeliveryMode != 0 {
		md[retrymeta.PropDeliveryModeKey] = strconv.Itoa(int(d.DeliveryMode))
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
	if v, ok := md[retrymeta.PropPriorityKey]; ok {
		if n, err := strconv.ParseUint(v, 10, 8); err == nil {
			p.Priority = uint8(n)
		}
		delete(p.Headers, retrymeta.PropPriorityKey)
	}
	if v, ok := md[retrymeta.PropTimestampKey]; ok {
		if ts, err := time.Parse(time.RFC3339, v); err == nil {
			p.Timestamp = ts
		}
		delete(p.Headers, retrymeta.PropTimestampKey)
	}
	if v, ok := md[retrymeta.PropDeliveryModeKey]; ok {
		if n, err := strconv.ParseUint(v, 10, 8); err == nil && n != 0 {
			p.DeliveryMode = uint8(n)
		}
		delete(p.Headers, retrymeta.PropDeliveryModeKey)
	}
}
