package faults

import (
	"fmt"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// setPolicy applies a policy (JSON definition) to the queues matching
// pattern for the rest of the test.
func setPolicy(t *testing.T, name, pattern, definition string) {
	t.Helper()
	haveRabbitmqctl(t)
	if _, err := rabbitmqctl(t, 30*time.Second, "set_policy", "--apply-to", "queues", "--priority", "100", name, pattern, definition); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = rabbitmqctl(t, 30*time.Second, "clear_policy", name) })
}

func clearPolicy(t *testing.T, name string) {
	t.Helper()
	if _, err := rabbitmqctl(t, 30*time.Second, "clear_policy", name); err != nil {
		t.Fatal(err)
	}
}

// startFailingOnce publishes n messages whose first attempt fails
// transiently, after starting a consumer on e; it returns their UUIDs and
// the ledger the handler writes.
func startFailingOnce(e *env, n int) ([]string, *ledger) {
	uuids, ps := newMessages(n, nil)
	plan := make(map[string]int, n)
	for _, u := range uuids {
		plan[u] = 1
	}
	l := newLedger()
	e.declare()
	e.start(planHandler(l, staticPlan(plan), 0, errTransient))
	e.publish(ps...)
	return uuids, l
}

// finishRun waits (at most timeout) for the published messages to settle,
// stops the consumer, drains the poison queue and logs the ACCOUNT line.
func finishRun(t *testing.T, e *env, uuids []string, l *ledger, timeout time.Duration) (accounting, bool) {
	t.Helper()
	settled := e.settle(len(uuids), l.handled, timeout)
	e.stop()
	poisoned, _ := e.poisoned()
	return account(t, uuids, l.successes(), poisoned), settled
}

// Item 1. Every wait queue refuses the retry copies (a max-length policy
// with overflow reject-publish: the broker nacks each publish). Before, the
// original was nacked into Q's dead-letter exchange, which classic queues
// do at most once: 290 of 300 were lost. Now the fallback pauses and
// publishes the copy straight back to Q (confirmed), counted as the next
// attempt; nothing relies on dead-lettering.
func TestWaitQueuesRefuseRetries(t *testing.T) {
	requireLong(t)
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt, func(_ *env, c *amqpretry.Config) { c.FallbackPause = 20 * time.Millisecond })
		// A quorum queue with reject-publish still takes a publish while it is
		// under the limit, so it refuses once it holds one message.
		limit := 0
		if qt == amqpretry.QueueTypeQuorum {
			limit = 1
		}
		setPolicy(t, "refuse-wait."+e.prefix, "^"+regexp.QuoteMeta(e.queue)+`\.wait\.`,
			fmt.Sprintf(`{"max-length":%d,"overflow":"reject-publish"}`, limit))
		const n = 300
		uuids, l := startFailingOnce(e, n)
		acc, settled := finishRun(t, e, uuids, l, 90*time.Second)
		if !settled {
			t.Errorf("did not settle")
		}
		e.checkEmpty()
		if acc.Handled != n {
			t.Errorf("handled %d of %d", acc.Handled, n)
		}
		fallbacks := len(e.logs.find("info", "Fallback copy held"))
		t.Logf("fallback copies: %d", fallbacks)
		if qt == amqpretry.QueueTypeClassic && fallbacks < n {
			t.Errorf("%d fallback copies, want one per message (%d)", fallbacks, n)
		}
	})
}

// Item 2. Deleting the loop-back exchange while retries wait: the wait
// queues dead-letter through the default exchange (which cannot be
// deleted), so every waiting retry still comes back to Q.
func TestLoopBackExchangeDeleted(t *testing.T) {
	requireLong(t)
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt, func(_ *env, c *amqpretry.Config) {
			c.Mode = amqpretry.Tiers(2 * time.Second)
			c.Backoff = exactBackoff(2 * time.Second)
		})
		const n = 50
		uuids, l := startFailingOnce(e, n)
		waitFor(t, 20*time.Second, "all retries waiting", func() bool { return e.depth(e.waitQueues()[0]) == n })
		ch := e.admin.channel()
		if err := ch.ExchangeDelete(e.naming.LoopBackExchange, false, false); err != nil {
			t.Fatal(err)
		}
		_ = ch.Close()
		acc, settled := finishRun(t, e, uuids, l, 30*time.Second)
		if !settled || acc.Handled != n {
			t.Errorf("settled %v, handled %d of %d", settled, acc.Handled, n)
		}
		e.checkEmpty()
	})
}

// Item 4. A message whose per-message TTL expires while it waits in Q
// (or a queue TTL, or a max-length overflow) is not taken into the retry
// path: classic Q has no dead-letter exchange, so RabbitMQ discards it as
// the producer asked; quorum Q dead-letters it to its poison queue (where a
// message past the delivery limit also lands), with x-death reason expired.
// Nothing waits a tier and meets the broker's dead-letter cycle detection.
func TestMessageExpiresInQueue(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt)
		e.declare()
		const n = 5
		uuids, ps := newMessages(n, nil)
		for i := range ps {
			ps[i].Expiration = "50"
		}
		e.publish(ps...)
		waitFor(t, 30*time.Second, "the messages to expire from Q", func() bool { return e.depth(e.queue) == 0 })
		for _, wq := range e.waitQueues() {
			if d := e.depth(wq); d != 0 {
				t.Errorf("%d expired message(s) in wait queue %s", d, wq)
			}
		}
		want := 0
		if qt == amqpretry.QueueTypeQuorum {
			want = n
			waitFor(t, 10*time.Second, "expired messages in the poison queue", func() bool { return e.poisonDepth() == n })
		}
		// Fresh messages still flow.
		l := newLedger()
		e.start(func(msg *message.Message) error { l.success(msg.UUID); return nil })
		fresh, fps := newMessages(3, nil)
		e.publish(fps...)
		waitFor(t, 10*time.Second, "fresh messages handled", func() bool { return l.handled() == len(fresh) })
		e.stop()
		poisoned, ds := e.poisoned()
		for _, u := range uuids {
			if l.successes()[u] > 0 {
				t.Errorf("expired message %s was handled", u)
			}
		}
		got := 0
		for _, u := range uuids {
			got += poisoned[u]
		}
		for _, d := range ds {
			if r, _ := d.Headers["x-first-death-reason"].(string); r != "expired" {
				t.Errorf("poisoned with x-first-death-reason %q, want expired", r)
			}
		}
		t.Logf("ACCOUNT %s: published=%d handled=0 poisoned=%d discarded(expired)=%d duplicates=0 lost=0", t.Name(), n, got, n-got)
		if got != want {
			t.Errorf("%d expired messages in the poison queue, want %d", got, want)
		}
		e.checkEmpty()
	})
}

// Item 6. The connection is lost under a running handler (the broker
// closes the consumer's connection while the handler holds the message),
// three times in a row, and each time the handler then fails. The failure
// cannot be settled on the dead delivery (no retry copy forks it); the
// redelivery to this process settles the remembered failure instead of
// running the handler again: the message runs once per attempt and ends in
// the poison queue (class exhausted) after MaxAttempts runs, never as
// attempt 1 forever. (A message that kills its process each time:
// TestCrashLoop.) Prefetch 1.
func TestCrashLoopEndsInPoison(t *testing.T) {
	requireLong(t)
	haveRabbitmqctl(t)
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) { c.Subscriber.Consume.Qos.PrefetchCount = 1 })
	pillUUIDs, pillPs := newMessages(1, func(int) []byte { return []byte("pill") })
	okUUIDs, okPs := newMessages(9, nil)
	l := newLedger()
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	var runs atomic.Int32
	e.declare()
	e.start(func(msg *message.Message) error {
		l.attempt(msg.UUID, middleware.Attempt(msg))
		if string(msg.Payload) == "pill" {
			if runs.Add(1) <= 3 {
				entered <- struct{}{}
				<-release
			}
			return errTransient
		}
		l.success(msg.UUID)
		return nil
	})
	e.publish(pillPs...)
	e.publish(okPs...)
	for crash := 1; crash <= 3; crash++ {
		select {
		case <-entered:
		case <-time.After(30 * time.Second):
			t.Fatalf("crash %d: the pill did not reach the handler", crash)
		}
		// The consumer "dies" with the pill in its handler. watermill-amqp
		// only reconnects once the handler returned, so release it first.
		consuming := len(e.logs.find("info", "Starting consuming from AMQP channel"))
		closeSubscriberConnection(t, e)
		release <- struct{}{}
		waitFor(t, 30*time.Second, "the subscriber to reconnect", func() bool {
			return len(e.logs.find("info", "Starting consuming from AMQP channel")) > consuming
		})
	}
	all := append(slices.Clone(pillUUIDs), okUUIDs...)
	settled := e.settle(len(all), l.handled, 30*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	acc := account(t, all, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	if acc.Poisoned != 1 || poisoned[pillUUIDs[0]] != 1 {
		t.Fatalf("pill poisoned %d times, %d poisoned in all", poisoned[pillUUIDs[0]], acc.Poisoned)
	}
	if c := ds[0].Headers[middleware.ErrorClassKey]; c != middleware.ClassExhausted {
		t.Errorf("pill poisoned with class %v, want %s", c, middleware.ClassExhausted)
	}
	if r := int(runs.Load()); r != e.cfg.MaxAttempts {
		t.Errorf("pill ran %d times, want MaxAttempts %d (one run per attempt)", r, e.cfg.MaxAttempts)
	}
	t.Logf("pill attempts %v; innocent messages handled %d", l.attemptsOf(pillUUIDs[0]), acc.Handled)
}

// Item 7. The poison queue refuses (max-length 0, reject-publish): before,
// the handler ran without limit (990 calls for 30 messages in 10 s). Now a
// message whose poison copy is refused is parked back in Q marked past its
// last attempt, after a pause, and is never handed to the handler again;
// once the poison queue accepts, each lands there once.
func TestPoisonQueueRefuses(t *testing.T) {
	requireLong(t)
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) {
		c.MaxAttempts = 3
		c.FallbackPause = 100 * time.Millisecond
	})
	policy := "refuse-poison." + e.prefix
	setPolicy(t, policy, "^"+regexp.QuoteMeta(e.poisonQueue())+"$", `{"max-length":0,"overflow":"reject-publish"}`)
	const n = 30
	uuids, ps := newMessages(n, nil)
	l := newLedger()
	var calls atomic.Int32
	e.declare()
	e.start(func(msg *message.Message) error {
		calls.Add(1)
		l.attempt(msg.UUID, middleware.Attempt(msg))
		return errTransient
	})
	e.publish(ps...)
	waitFor(t, 30*time.Second, "every message through its 3 attempts", func() bool { return int(calls.Load()) >= n*3 })
	// Let the refused poison publishes cycle for a while: no further calls.
	atThree := calls.Load()
	cycles := len(e.logs.find("error", "Poison publish failed"))
	waitFor(t, 30*time.Second, "the refused poison publishes to cycle", func() bool {
		return len(e.logs.find("error", "Poison publish failed")) >= cycles+2*n
	})
	if c := calls.Load(); c != atThree || int(c) != n*3 {
		t.Errorf("handler calls %d after the poison queue refused (%d at the time), want %d", c, atThree, n*3)
	}
	clearPolicy(t, policy)
	waitFor(t, 30*time.Second, "every message poisoned", func() bool { return e.poisonDepth() == n })
	settled := e.settle(n, l.handled, 20*time.Second)
	e.stop()
	poisoned, _ := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	if !settled || acc.Poisoned != n {
		t.Errorf("settled %v, poisoned %d of %d", settled, acc.Poisoned, n)
	}
	for _, u := range uuids {
		if a := l.attemptsOf(u); len(a) != 3 {
			t.Errorf("%s: attempts %v, want 3", u, a)
		}
	}
	e.checkEmpty()
	t.Logf("handler calls %d for %d messages (MaxAttempts 3); refused poison publishes %d", calls.Load(), n,
		len(e.logs.find("error", "Poison publish failed")))
}

// Item 8. Graceful shutdown while messages are mid-flight on their last
// attempt. With Retry.NewSubscriber (router.DrainingSubscriber) the handlers
// finish before the subscriber closes: a success is acked, nothing is
// poisoned by the shutdown and nothing runs again. With watermill-amqp's
// plain subscriber, whose Close nacks in-flight deliveries while handlers
// run, a handler that honours its context returns context.Canceled, which
// the chain neither retries nor poisons (the delivery is already back in
// Q); the message runs its last attempt again after the restart, and no
// attempt number exceeds MaxAttempts.
func TestShutdownAtLastAttempt(t *testing.T) {
	for _, plain := range []bool{false, true} {
		t.Run(fmt.Sprintf("plainSubscriber=%v", plain), func(t *testing.T) {
			e := newEnv(t, "classic", func(e *env, c *amqpretry.Config) {
				c.MaxAttempts = 3
				e.plainSubscriber = plain
			})
			const n = 4
			uuids, ps := newMessages(n, nil)
			l := newLedger()
			var mu sync.Mutex
			midFlight := map[string]bool{}
			release := make(chan struct{})
			e.declare()
			e.start(func(msg *message.Message) error {
				a := middleware.Attempt(msg)
				l.attempt(msg.UUID, a)
				if a < 3 {
					return errTransient
				}
				mu.Lock()
				midFlight[msg.UUID] = true
				mu.Unlock()
				select {
				case <-release:
				case <-msg.Context().Done():
					return msg.Context().Err()
				}
				l.success(msg.UUID)
				return nil
			})
			e.publish(ps...)
			waitFor(t, 20*time.Second, "a message mid-flight on its last attempt", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(midFlight) > 0
			})
			stopped := make(chan struct{})
			go func() { e.stop(); close(stopped) }()
			if ds, ok := e.sub.(*router.DrainingSubscriber); ok {
				<-ds.Draining()
				close(release) // the drained handler finishes
				<-stopped
			} else {
				<-stopped // the handler returned on its cancelled context
				close(release)
			}
			if d := e.poisonDepth(); d != 0 {
				t.Fatalf("%d message(s) poisoned by the shutdown", d)
			}
			e.start(func(msg *message.Message) error {
				a := middleware.Attempt(msg)
				l.attempt(msg.UUID, a)
				if a < 3 {
					return errTransient
				}
				l.success(msg.UUID)
				return nil
			})
			settled := e.settle(n, l.handled, 30*time.Second)
			e.stop()
			poisoned, _ := e.poisoned()
			acc := account(t, uuids, l.successes(), poisoned)
			if !settled || acc.Poisoned != 0 || acc.Handled != n {
				t.Errorf("settled %v handled %d poisoned %d", settled, acc.Handled, acc.Poisoned)
			}
			for _, u := range uuids {
				as := l.attemptsOf(u)
				if slices.Max(as) > 3 {
					t.Errorf("%s: attempts %v exceed MaxAttempts", u, as)
				}
				if !plain && len(as) > 3 {
					t.Errorf("%s: ran %d times with the draining subscriber: %v", u, len(as), as)
				}
				if l.successes()[u] != 1 {
					t.Errorf("%s: %d successes", u, l.successes()[u])
				}
			}
			e.checkEmpty()
			t.Logf("attempts: %v", func() (out [][]int) {
				for _, u := range uuids {
					out = append(out, l.attemptsOf(u))
				}
				return
			}())
		})
	}
}
