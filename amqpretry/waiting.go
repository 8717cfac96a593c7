package amqpretry

import (
	"context"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// WaitingDepth is one queue of the retry path and the messages ready in it.
// It converts to metrics.WaitingCount (the same fields).
type WaitingDepth struct {
	// Queue is the originating queue the messages belong to.
	Queue string
	// Stage is the wait queue's tier ("1s", "30s") or "poison".
	Stage string
	// Messages is the queue's ready message count (queue.declare-ok).
	Messages int
}

// Waiting reads the depth of each given originating queue's wait queues
// (one per tier) and poison queue, with a passive queue.declare per queue
// on the retry publisher's connection ("Queues": a passive declare returns
// the message count; on RabbitMQ 4.3 a quorum queue's native delayed
// messages are not in it). A queue that does not exist is skipped. It
// returns the first other broker error, or ctx's. Feed it to
// metrics.NewWaitingCollector for the waiting_messages gauge.
func (r *Retry) Waiting(ctx context.Context, queues ...string) ([]WaitingDepth, error) {
	var out []WaitingDepth
	for _, q := range queues {
		stages := make([]struct{ name, stage string }, 0, len(r.topology.tiers)+1)
		for _, tier := range r.topology.tiers {
			stages = append(stages, struct{ name, stage string }{r.topology.naming.WaitQueue(q, tier), retrymeta.FormatDelay(tier)})
		}
		stages = append(stages, struct{ name, stage string }{r.topology.naming.PoisonQueue(q), "poison"})
		for _, s := range stages {
			if err := ctx.Err(); err != nil {
				return out, err
			}
			n, ok, err := r.depth(s.name)
			if err != nil {
				return out, err
			}
			if ok {
				out = append(out, WaitingDepth{Queue: q, Stage: s.stage, Messages: n})
			}
		}
	}
	return out, nil
}

// depth returns the ready count of queue name; ok false when it does not
// exist (404 closes only the channel used for the check).
func (r *Retry) depth(name string) (n int, ok bool, err error) {
	ch, err := r.publisher.Channel()
	if err != nil {
		return 0, false, fmt.Errorf("amqpretry: opening a channel to read %q: %w", name, err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
	if err != nil {
		if aerr := (*amqp.Error)(nil); errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
			return 0, false, nil
		}
		return 0, false, fmt.Errorf("amqpretry: reading the depth of %q: %w", name, err)
	}
	return st.Messages, true, nil
}
