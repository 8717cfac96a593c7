package amqpretry_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// Two queues bound to one exchange with the same routing key; A fails twice
// then succeeds: A sees attempts 1, 2, 3 with each retry no earlier than its
// tier; B sees the message exactly once.
func TestE2E_RetryReturnsToFailingQueueOnly(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt)
		recA, recB := newRecorder(), newRecorder()
		qa := e.handle("a", func(msg *message.Message) error {
			n := middleware.Attempt(msg)
			recA.record(msg, n)
			if n < 3 {
				return errTransient
			}
			return nil
		})
		qb := e.handle("b", func(msg *message.Message) error {
			recB.record(msg, middleware.Attempt(msg))
			return nil
		})
		e.start()
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":1}`))
		msg.Metadata.Set("user-key", "kept")
		e.publish(msg)

		waitFor(t, 15*time.Second, "3 attempts on A", func() bool { return recA.count(msg.UUID) == 3 })
		attempts, times := recA.get(msg.UUID)
		if attempts[0] != 1 || attempts[1] != 2 || attempts[2] != 3 {
			t.Fatalf("A saw attempts %v, want [1 2 3]", attempts)
		}
		tiers := e.retry.Topology().Tiers() // 100ms, 200ms
		if len(tiers) != 2 || tiers[0] != 100*time.Millisecond || tiers[1] != 200*time.Millisecond {
			t.Fatalf("tiers %v, want [100ms 200ms]", tiers)
		}
		for i := 1; i < 3; i++ {
			gap := times[i].Sub(times[i-1])
			if gap < tiers[i-1] {
				t.Errorf("attempt %d came %v after attempt %d, earlier than its tier %v", i+1, gap, i, tiers[i-1])
			}
			if gap > tiers[i-1]+2*time.Second {
				t.Errorf("attempt %d came %v after attempt %d, far later than its tier %v", i+1, gap, i, tiers[i-1])
			}
		}
		e.waitQueuesEmpty(qa, 5*time.Second)
		if n := recB.count(msg.UUID); n != 1 {
			t.Fatalf("B saw the message %d times, want exactly 1", n)
		}
		if d := e.depth(qb); d != 0 {
			t.Fatalf("B queue depth %d", d)
		}
		if d := e.depth(e.retry.Topology().PoisonQueue(qa)); d != 0 {
			t.Fatalf("poison queue has %d messages, want 0", d)
		}
		recA.mu.Lock()
		last := recA.meta[msg.UUID][2]
		recA.mu.Unlock()
		if last.Get("user-key") != "kept" {
			t.Errorf("user metadata lost on retry: %v", last)
		}
		if last.Get(middleware.OriginalQueueKey) != qa || last.Get(middleware.OriginalExchangeKey) != e.exchange ||
			last.Get(middleware.OriginalRoutingKeyKey) != "order.created" {
			t.Errorf("original delivery metadata wrong: %v", last)
		}
	})
}
