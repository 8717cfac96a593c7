package testkit

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// DelayerFunc adapts a function to middleware.Delayer, for tests that stub
// or wrap a Delayer (e.g. failing some schedules of a MemoryDelayer).
type DelayerFunc func(ctx context.Context, msg *message.Message, delay time.Duration) error

// Schedule calls f.
func (f DelayerFunc) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	return f(ctx, msg, delay)
}
