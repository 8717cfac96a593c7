package amqpretry

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// PlannedDelay is the wait a retry gets: the nearest tier for a backoff
// delay, the next tier up for a RetryAfter, the whole delay beyond the
// longest tier.
func TestPlannedDelay(t *testing.T) {
	topo := newTopology(Naming{}, []time.Duration{time.Second, 4 * time.Second, 16 * time.Second}, QueueTypeClassic, false, watermill.NopLogger{})
	d := &tiersDelayer{topology: topo}
	ctx := context.Background()
	for _, c := range []struct {
		ctx   context.Context
		delay time.Duration
		want  time.Duration
	}{
		{ctx, 3 * time.Second, 4 * time.Second},
		{ctx, 1500 * time.Millisecond, time.Second},
		{retrymeta.WithMinimumDelay(ctx, 1500*time.Millisecond), 1500 * time.Millisecond, 4 * time.Second},
		{ctx, time.Minute, time.Minute},
		{ctx, 0, 0},
	} {
		if got := d.PlannedDelay(c.ctx, c.delay); got != c.want {
			t.Errorf("PlannedDelay(%v) = %v, want %v", c.delay, got, c.want)
		}
	}
}
