package amqpretry

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// poisonPublisher publishes to the poison exchange with confirms; the topic is
// the poison queue name (its binding key). A copy too large for a frame loses
// its largest user headers first (fitHeaders). If the poison queue is missing, it
// redeclares the originating queue's topology (named by OriginalQueueKey) and
// tries once more; a failure is returned, so the original is nacked.
type poisonPublisher struct {
	publisher *confirm.Publisher
	topology  *Topology
	marshaler Marshaler
	logger    watermill.LoggerAdapter
}

func (p *poisonPublisher) Publish(topic string, msgs ...*message.Message) error {
	ps := make([]amqp.Publishing, 0, len(msgs))
	for _, m := range msgs {
		pub, err := p.marshaler.Marshal(m)
		if err != nil {
			return fmt.Errorf("amqpretry: marshaling poison copy: %w", err)
		}
		wire.FitHeaders(&pub)
		ps = append(ps, pub)
	}
	ex := p.topology.naming.PoisonExchange
	err := p.publisher.PublishRawBatch(context.Background(), ex, topic, ps)
	if err == nil || !topologyMissing(err) || len(msgs) == 0 {
		return err
	}
	q := msgs[0].Metadata.Get(middleware.OriginalQueueKey)
	p.logger.Error("Poison publish found no poison queue; redeclaring topology", err, watermill.LogFields{"queue": q, "poison_queue": topic})
	if rerr := p.topology.redeclare(p.publisher.Channel, q); rerr != nil {
		return errors.Join(err, fmt.Errorf("amqpretry: redeclaring topology of %q: %w", q, rerr))
	}
	return p.publisher.PublishRawBatch(context.Background(), ex, topic, ps)
}

func (p *poisonPublisher) Close() error { return nil }
