package amqpretry_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// A RetryAfter longer than the longest wait-queue tier (issue 18 item 8):
// tiers [200ms, 400ms], RetryAfter(1.5s) on attempts 1 and 2. Each retry
// runs no earlier than 1.5 s after the attempt before it (the copy is held
// for 400 ms, carries the remaining delay, and the RedeliveryGuard holds it
// again without running it, until the whole delay is over); attempts are 1,
// 2, 3 (the extra hops use no attempt and no redelivery); nothing is lost.
// Before, every retry ran about 400 ms after the attempt before it.
//
// The same on a quorum queue with DeadLetterFirstRetry and one tier [400ms]
// (the dead-letter hop carries no header, so a delay longer than the first
// tier must take the publish path), and on 4.3 with NativeDelayedRetry
// {Min 200ms, Max 1s} and a backoff delay of 1.5 s (above Max: wait queues;
// attempts counted from x-acquired-count must survive the extra hops).
func TestE2E_RetryAfterBeyondLongestTier(t *testing.T) {
	const (
		n     = 10
		asked = 1500 * time.Millisecond
	)
	two := []time.Duration{200 * time.Millisecond, 400 * time.Millisecond}
	twoTiers := func(c *amqpretry.Config) { c.Mode = amqpretry.Tiers(two...) }
	for _, v := range []struct {
		name       string
		queueType  string
		opt        envOption
		only43     bool
		retryAfter bool // the handler asks RetryAfter(asked); else the backoff gives asked
	}{
		{"classic", amqpretry.QueueTypeClassic, twoTiers, false, true},
		{"quorum", amqpretry.QueueTypeQuorum, twoTiers, false, true},
		{"quorum-backoff", amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) {
			twoTiers(c)
			c.Backoff = fixedBackoff(asked)
		}, false, false},
		{"quorum-deadletterfirst", amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) {
			c.Mode = amqpretry.DeadLetterFirst(400 * time.Millisecond)
		}, false, true},
		{"quorum-native", amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) {
			c.Backoff = fixedBackoff(asked)
			c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: 200 * time.Millisecond, Max: time.Second, Tiers: two})
		}, true, false},
	} {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			if v.only43 {
				broker43(t)
			}
			e := newEnv(t, v.queueType, v.opt)
			rec := newRecorder()
			var mu sync.Mutex
			runs := map[string]map[int]int{} // uuid → attempt → runs
			q := e.handle("svc", func(msg *message.Message) error {
				a := middleware.Attempt(msg)
				rec.record(msg, a)
				mu.Lock()
				if runs[msg.UUID] == nil {
					runs[msg.UUID] = map[int]int{}
				}
				runs[msg.UUID][a]++
				mu.Unlock()
				if a >= 3 {
					return nil
				}
				if v.retryAfter {
					return middleware.RetryAfter(errTransient, asked)
				}
				return errTransient
			})
			e.start()
			var msgs []*message.Message
			for i := 0; i < n; i++ {
				msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i))))
			}
			e.publish(msgs...)
			handled := func() int {
				k := 0
				for _, m := range msgs {
					if rec.count(m.UUID) >= 3 {
						k++
					}
				}
				return k
			}
			pq := e.retry.Topology().Naming().PoisonQueue(q)
			waitFor(t, 30*time.Second, "every message's third attempt", func() bool { return handled()+e.depth(pq) == n })
			e.waitQueuesEmpty(q, 10*time.Second)

			earliest := time.Duration(1<<63 - 1)
			duplicates := 0
			for _, m := range msgs {
				attempts, times := rec.get(m.UUID)
				if fmt.Sprint(attempts) != "[1 2 3]" {
					t.Errorf("message %s: attempts %v, want [1 2 3]", m.UUID, attempts)
				}
				for i := 1; i < len(times); i++ {
					earliest = min(earliest, times[i].Sub(times[i-1]))
				}
				mu.Lock()
				for _, c := range runs[m.UUID] {
					duplicates += c - 1
				}
				mu.Unlock()
			}
			poisoned := e.depth(pq)
			h := handled()
			t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d", t.Name(), n, h, poisoned, duplicates, n-h-poisoned)
			t.Logf("earliest retry %v after the attempt before it (asked %v, longest tier %v)", earliest, asked, e.retry.Topology().Tiers())
			if earliest < asked {
				t.Errorf("a retry ran %v after the attempt before it, earlier than the %v asked", earliest, asked)
			}
			if h != n || poisoned != 0 || duplicates != 0 {
				t.Errorf("handled %d, poisoned %d, duplicates %d; want %d, 0, 0", h, poisoned, duplicates, n)
			}
		})
	}
}
