package cascadecore

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// LevelCount is what Waiting reports for one level.
type LevelCount struct {
	// Level is n: the queue holds messages 2^n grains.
	Level int
	// Queue is the level queue's name.
	Queue string
	// TTL is the level queue's x-message-ttl: 2^n × Grain.
	TTL time.Duration
	// Messages is the number of messages ready in the queue, as queue.declare
	// (passive) reports it ("Queues", passive declare): messages waiting
	// out this level's TTL. Level queues have no consumers, so none are
	// unacknowledged; a quorum queue's count does not include messages
	// already expired and waiting to be dead-lettered.
	Messages int
	// Consumers should be 0: anything consuming a level queue takes
	// messages out of the cascade.
	Consumers int
	// DeadLettering is the level's dead-letter backlog: messages that
	// expired out of this level and that RabbitMQ's at-least-once
	// dead-letter worker has not yet handed to the next level (a quorum
	// queue's messages_dlx, "Quorum Queues", at-least-once
	// dead-lettering), read from the management API, which refreshes it
	// about every 5 s. Normally 0 or a few in transit; a lasting backlog
	// means the next hop had no route or refused them (a deleted level
	// queue or exchange, a length limit): they are still safe in this
	// queue and the worker retries them every
	// dead_letter_worker_publisher_confirm_timeout (3 min by default).
	// These messages are not in Messages: the cascade holds Messages +
	// DeadLettering. -1 when unknown: Config.ManagementURL not set, a
	// classic level (no buffer: it dead-letters at-most-once), or a queue
	// the management API has no statistics for yet (created seconds ago).
	DeadLettering int
	// LengthLimit lists the length limits in force on the level queue
	// ("max-length=100", "max-length-bytes=…", from a policy, an operator
	// policy or an argument; "Queue Length Limit"), read from the
	// management API; "" when none, or when Config.ManagementURL is not
	// set. Levels must have none: a full quorum level refuses publishes
	// (x-overflow reject-publish: the Delayer and Publisher hold the
	// message and publish it again, see Config.FullWait) and
	// dead-lettering into it (the messages wait in the level above for
	// the dead-letter worker's retry, minutes late).
	LengthLimit string
	// Full reports the level at its length limit: its count at or above
	// the max-length the management API shows, or (Delayer.Waiting,
	// Publisher.Waiting) it refused a publish of this Delayer or Publisher
	// and has not shown room since (a publish accepted, or its ready
	// count below the count it had when it refused, read at each
	// TopologyCheck). A full level refuses scheduled messages (they are
	// held, see Config.FullWait) and dead-lettering from the level above
	// (that level's DeadLettering grows).
	Full bool
	// Refused counts the publishes this level refused (basic.nack) since
	// the Delayer or Publisher started, held messages' retries included;
	// 0 from Config.Waiting.
	Refused int
}

// Waiting reports, per level (level 0 first), how many messages wait in
// the level queue, with a passive queue.declare each. A message is counted
// in the level it is in now; how long it still waits, and for which
// destination, is in its routing key and dueHeader, which can only be read
// by consuming it: Census does, and gives per-destination counts. A ready
// count does not include the level's dead-letter backlog (messages that
// expired and are not yet in the next level): with Config.ManagementURL
// set, Waiting reads it (and length limits) from the management API, one
// GET for all levels (LevelCount.DeadLettering, LengthLimit); without,
// DeadLettering is -1. It returns Validate's error, ctx's error (checked
// between declares), the broker's error (a missing level queue: 404
// NOT_FOUND, which closes ch), or the management API's error (with the
// counts read so far).
func (c Config) Waiting(ctx context.Context, ch *amqp.Channel) ([]LevelCount, error) {
	c, err := c.resolved()
	if err != nil {
		return nil, err
	}
	counts := make([]LevelCount, 0, c.Levels)
	for n := 0; n < c.Levels; n++ {
		if err := ctx.Err(); err != nil {
			return counts, err
		}
		q, err := ch.QueueDeclarePassive(c.LevelName(n), true, false, false, false, c.levelArgs(n))
		if err != nil {
			return counts, fmt.Errorf("cascade: inspecting level queue %q: %w", c.LevelName(n), err)
		}
		counts = append(counts, LevelCount{Level: n, Queue: q.Name, TTL: levelTTL(c.Grain, n), Messages: q.Messages, Consumers: q.Consumers, DeadLettering: -1})
	}
	if c.ManagementURL == "" {
		return counts, nil
	}
	stats, err := c.levelStats(ctx)
	if err != nil {
		return counts, err
	}
	for i := range counts {
		s, ok := stats[counts[i].Queue]
		if !ok {
			continue
		}
		if s.MessagesDLX != nil {
			counts[i].DeadLettering = *s.MessagesDLX
		}
		counts[i].LengthLimit = s.lengthLimit()
		counts[i].Full = s.atLimit()
	}
	return counts, nil
}
