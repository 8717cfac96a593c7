package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrClosed is the one "closed" error of the library: every closable type
// returns it (wrapped, naming what was closed; test with errors.Is) when
// called after its Close: MemoryDelayer.Schedule,
// router.DrainingSubscriber.Subscribe, audit.Recorder (logged and counted,
// see audit.Recorder.Record) and audit.Resender, poison/admin.Admin.
// confirm.Publisher, below this package in the layers, has its own
// confirm.ErrClosed.
var ErrClosed = errors.New("closed")

// errDelayerClosed is returned by MemoryDelayer.Schedule after Close.
var errDelayerClosed = fmt.Errorf("delayer: %w", ErrClosed)

// MemoryDelayer is an in-process Delayer: it keeps each copy in a timer and
// publishes it to the subscribe topic it came from when the delay is over.
//
// It is NOT durable: messages waiting in it are lost if the process exits,
// and Close reports how many were dropped. Use it with gochannel and in
// tests; with RabbitMQ use amqpretry, where the broker holds waiting
// messages.
type MemoryDelayer struct {
	pub    message.Publisher
	topic  func(ctx context.Context) string
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	closed  bool
	pending map[*time.Timer]struct{}
	wg      sync.WaitGroup
}

// NewMemoryDelayer returns a MemoryDelayer publishing with pub. topic names
// the topic a copy is published to; nil means the router's subscribe topic
// (message.SubscribeTopicFromCtx). logger may be nil.
func NewMemoryDelayer(pub message.Publisher, topic func(ctx context.Context) string, logger watermill.LoggerAdapter) (*MemoryDelayer, error) {
	if pub == nil {
		return nil, errors.New("NewMemoryDelayer: pub is nil")
	}
	if topic == nil {
		topic = message.SubscribeTopicFromCtx
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &MemoryDelayer{pub: pub, topic: topic, logger: logger, pending: map[*time.Timer]struct{}{}}, nil
}

// Schedule publishes msg to the topic after delay. It returns an error when
// the context names no topic or after Close. A publish that fails when the
// timer fires is logged (the message is then lost: this Delayer is not
// durable).
func (d *MemoryDelayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	topic := d.topic(ctx)
	if topic == "" {
		return errors.New("MemoryDelayer: no topic for the message (use it inside a message.Router, or pass a topic function)")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errDelayerClosed
	}
	d.wg.Add(1)
	var t *time.Timer
	t = time.AfterFunc(max(delay, 0), func() {
		defer d.wg.Done()
		d.mu.Lock()
		_, live := d.pending[t]
		delete(d.pending, t)
		d.mu.Unlock()
		if !live {
			return
		}
		if err := d.pub.Publish(topic, msg); err != nil {
			d.logger.Error("MemoryDelayer: publishing delayed message failed; message lost", err,
				watermill.LogFields{"message_uuid": msg.UUID, "topic": topic})
		}
	})
	d.pending[t] = struct{}{}
	return nil
}

// Pending returns how many messages are waiting.
func (d *MemoryDelayer) Pending() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.pending)
}

// Close stops all timers and waits for publishes in progress. It returns an
// error saying how many waiting messages were dropped, if any.
func (d *MemoryDelayer) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	dropped := 0
	for t := range d.pending {
		if t.Stop() {
			d.wg.Done()
			dropped++
			delete(d.pending, t)
		}
		// Stop returned false: the timer already fired and its function is
		// waiting for d.mu. Leave it pending so that it still publishes (a
		// publish in progress, which Close waits for); deleting it here
		// would make it drop the message silently, uncounted.
	}
	d.mu.Unlock()
	d.wg.Wait()
	if dropped > 0 {
		return fmt.Errorf("MemoryDelayer closed with %d waiting messages dropped (not durable)", dropped)
	}
	return nil
}
