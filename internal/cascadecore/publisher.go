package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrDelayTooLong is wrapped by Publisher.Publish for a message scheduled
// further ahead than MaxDelay: delivering it at MaxDelay would be early, so
// it is refused (the Delayer, whose retries may come back early, clamps
// instead).
var ErrDelayTooLong = errors.New("cascade: scheduled delay exceeds the cascade's maximum")

// Publisher is a watermill message.Publisher that delivers each message to
// the queue named by the topic after the delay set by Watermill's delay
// component (github.com/ThreeDotsLabs/watermill/components/delay:
// delay.Message(msg, delay.For(d)), delay.Until(t), or delay.WithContext
// through a delay.NewPublisher wrapping this one; and
// router/middleware.DelayOnError), through the delay cascade. A message
// without delay metadata is delivered at once. Safe for concurrent use.
//
// So on RabbitMQ, scheduled messages and DelayOnError work without the
// delayed-message exchange plugin: for DelayOnError, use a Publisher as the
// PoisonQueue middleware's publisher and the consumer's queue as its topic.
type Publisher struct {
	c   *core
	now func() time.Time
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher for cfg (defaults applied); see
// NewDelayer for Publisher/URI, errors and when the cascade is declared.
func NewPublisher(cfg Config) (*Publisher, error) {
	c, err := newCore(cfg)
	if err != nil {
		return nil, err
	}
	return &Publisher{c: c, now: time.Now}, nil
}

// Publish publishes each message, in order, to the cascade with its delay
// (see messageDelay) and topic as the destination queue, and returns once
// the broker confirmed it (mandatory, publisher confirms, under the
// message's context). The first publish to a topic binds its queue
// (BindDestination), which must exist. The delay metadata stays on the
// message (its consumer sees it).
//
// Errors, stopping at the first failed message (the earlier ones are
// published): unreadable delay metadata; ErrDelayTooLong (wrapped); a
// topic the cascade cannot route (ErrBadQueueName); a declare or bind
// error (*amqpretry.DeclareError, e.g. 404 for a missing queue); or the
// publisher's (confirm.ErrNacked, ErrConfirmTimeout, ...).
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	cfg := &p.c.cfg
	if err := cfg.checkQueue(topic); err != nil {
		return err
	}
	for _, msg := range msgs {
		d, _, err := messageDelay(msg, p.now())
		if err != nil {
			return fmt.Errorf("cascade: message %s: %w", msg.UUID, err)
		}
		n, ok := cfg.grains(d)
		if !ok {
			return fmt.Errorf("%w: message %s: %v > %v", ErrDelayTooLong, msg.UUID, d, cfg.maxDelay())
		}
		ctx := msg.Context()
		if ctx == nil {
			ctx = context.Background()
		}
		if err := p.c.send(ctx, msg, n, topic); err != nil {
			return fmt.Errorf("cascade: publishing message %s to %q: %w", msg.UUID, topic, err)
		}
	}
	return nil
}

// messageDelay returns how long from now msg should still wait, from the
// metadata of Watermill's delay component (delay.DelayedUntilKey, an RFC
// 3339 time, and delay.DelayedForKey, a Go duration): ok is false, and the
// delay 0, for a message with neither. delay.Message writes the time to the
// second only (time.RFC3339), so when both are present the due time is
// somewhere in [until, until+1s) and at most now+for: the result is
// min(for, until+1s-now), exact for a message published as soon as it was
// marked and never early. With only a time (or one with fractional
// seconds): until-now. With only a duration: for. Never negative. An
// unparseable value is an error.
func messageDelay(msg *message.Message, now time.Time) (d time.Duration, ok bool, err error) {
	untilStr, forStr := msg.Metadata.Get(delay.DelayedUntilKey), msg.Metadata.Get(delay.DelayedForKey)
	if untilStr == "" && forStr == "" {
		return 0, false, nil
	}
	var until time.Time
	if untilStr != "" {
		if until, err = time.Parse(time.RFC3339, untilStr); err != nil {
			return 0, false, fmt.Errorf("metadata %s: %w", delay.DelayedUntilKey, err)
		}
	}
	var dfor time.Duration
	if forStr != "" {
		if dfor, err = time.ParseDuration(forStr); err != nil {
			return 0, false, fmt.Errorf("metadata %s: %w", delay.DelayedForKey, err)
		}
	}
	switch {
	case untilStr == "":
		d = dfor
	case forStr == "" || until.Nanosecond() != 0:
		d = until.Sub(now)
	default:
		d = min(dfor, until.Add(time.Second).Sub(now))
	}
	return max(d, 0), true, nil
}

// Bind declares the cascade and binds queue now (see Delayer.Bind).
func (p *Publisher) Bind(queue string) error { return p.c.bind(queue) }

// Waiting reports per level how many messages wait (see Config.Waiting).
func (p *Publisher) Waiting(ctx context.Context) ([]LevelCount, error) {
	return p.c.waiting(ctx)
}

// Close closes the publisher if NewPublisher dialled it (Config.URI); a
// Config.Publisher is left open.
func (p *Publisher) Close() error { return p.c.close() }
