package amqpretry

import (
	"errors"
	"maps"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"
)

// amqpConfigFromSubscriber returns the amqp.Config for the retry publisher
// from a watermill-amqp subscriber's connection settings, the way
// watermill-amqp dials with them (ConnectionConfig.AmqpConfig, else
// ConnectionConfig.TLSConfig): nil when neither is set. Properties and the
// TLS config are copied (amqp091-go writes into both while dialling);
// Recovery is dropped. Setting both TLSConfig and AmqpConfig.TLSClientConfig
// is an error, as in watermill-amqp.
func amqpConfigFromSubscriber(c wamqp.ConnectionConfig) (*amqp.Config, error) {
	if c.AmqpConfig != nil && c.AmqpConfig.TLSClientConfig != nil && c.TLSConfig != nil {
		return nil, errors.New("amqpretry.Config.Subscriber.Connection sets both TLSConfig and AmqpConfig.TLSClientConfig")
	}
	if c.AmqpConfig == nil && c.TLSConfig == nil {
		return nil, nil
	}
	var ac amqp.Config
	if c.AmqpConfig != nil {
		ac = *c.AmqpConfig
	}
	if c.TLSConfig != nil {
		ac.TLSClientConfig = c.TLSConfig
	}
	if ac.TLSClientConfig != nil {
		ac.TLSClientConfig = ac.TLSClientConfig.Clone()
	}
	ac.Properties = maps.Clone(ac.Properties)
	ac.Recovery = nil
	return &ac, nil
}
