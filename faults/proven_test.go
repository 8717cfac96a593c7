package faults

import (
	"errors"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// TestAttemptsNotChargedByHeldShutdowns (issue #18 item 1): on a RabbitMQ
// 4.3 quorum queue, a message the Pause holds while the dependency is down
// is nacked with requeue when the router stops, which raises its
// x-acquired-count although no attempt failed. MaxAttempts 2, the router
// stopped twice while the message is held, then restarted with the
// dependency up: the message runs and succeeds. (Before the fix the nacks
// made it attempt 3 > MaxAttempts and it was poisoned without running.)
// ~22 s (two graceful stops with a held message): RABBITRETRY_FAULTS=1.
func TestAttemptsNotChargedByHeldShutdowns(t *testing.T) {
	if os.Getenv("RABBITRETRY_FAULTS") != "1" {
		t.Skip("~22 s: run it with RABBITRETRY_FAULTS=1")
	}
	if !brokerAtLeast43() {
		t.Skip("x-acquired-count needs RabbitMQ 4.3+ (RABBITRETRY_BROKER_VERSION)")
	}
	pc := &pauseCounter{}
	e := newEnv(t, "quorum", func(_ *env, c *amqpretry.Config) {
		c.MaxAttempts = 2
		c.Pause = &middleware.PauseConfig{ProbeInterval: 100 * time.Millisecond, MaxProbeInterval: 200 * time.Millisecond, Observer: pc}
	})
	var down atomic.Bool
	down.Store(true)
	var outageRuns atomic.Int64
	l := newLedger()
	h := func(msg *message.Message) error {
		if down.Load() {
			outageRuns.Add(1)
			return middleware.DependencyUnavailable(errors.New("payment gateway: connection refused"))
		}
		l.attempt(msg.UUID, middleware.Attempt(msg))
		l.success(msg.UUID)
		return nil
	}
	uuids, ps := newMessages(1, nil)
	e.start(h)
	e.publish(ps...)
	for i := 1; i <= 2; i++ {
		runs := outageRuns.Load()
		waitFor(t, 15*time.Second, "held by the pause", func() bool { return pc.started.Load() > pc.ended.Load() && outageRuns.Load() > runs })
		e.stop() // the held message is nacked with requeue, handler not charged
		if i == 1 {
			e.start(h)
		}
	}
	down.Store(false)
	e.start(h)
	waitFor(t, 30*time.Second, "handled or poisoned", func() bool { return l.handled() == 1 || e.poisonDepth() > 0 })
	if !e.settle(1, l.handled, 20*time.Second) {
		t.Error("queues did not settle")
	}
	poisoned, _ := e.poisoned()
	a := account(t, uuids, l.successes(), poisoned)
	if a.Poisoned != 0 || l.handled() != 1 {
		t.Errorf("poisoned %d, handled %d: want the message to run and succeed", a.Poisoned, l.handled())
	}
	t.Logf("outage runs %d, attempts seen after the outage %v", outageRuns.Load(), l.attemptsOf(uuids[0]))
}
