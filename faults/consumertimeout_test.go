package faults

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// brokerAtLeast4 reports whether the broker under test is RabbitMQ 4.x or
// later (RABBITRETRY_BROKER_VERSION, set by scripts/brokers.sh env).
func brokerAtLeast4() bool {
	v := os.Getenv("RABBITRETRY_BROKER_VERSION")
	return v != "" && !strings.HasPrefix(v, "3.")
}

// A handler slower than the queue's consumer_timeout (RabbitMQ 4.x quorum
// queues: the broker cancels the consumer, without closing the channel, and
// returns its unacked messages; "Delivery Acknowledgement Timeout"). The
// late ack is void, so the slow message must not fork (no retry copy for a
// delivery the broker took back) and the consumer must keep consuming. The
// handler's failure, which could not be settled, is remembered: its
// redelivery is not run again but retried as that failure, so the slow
// message runs once per attempt and ends in the poison queue (class
// exhausted) after MaxAttempts runs, instead of running forever. The other
// messages are each handled.
func TestConsumerTimeoutSlowHandler(t *testing.T) {
	requireDisruptive(t) // slow (~1 min); run with the fault suite
	if !brokerAtLeast4() {
		t.Skip("per-queue consumer timeout (x-consumer-timeout) and its cancel-without-close are RabbitMQ 4.x behaviour")
	}
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
		c.Subscriber.Queue.Arguments = map[string]any{"x-consumer-timeout": int64(2000)}
		c.Subscriber.Consume.Qos.PrefetchCount = 1
	})
	slowUUIDs, slowPs := newMessages(1, func(int) []byte { return []byte("slow") })
	okUUIDs, okPs := newMessages(5, nil)
	l := newLedger()
	var slowRuns atomic.Int32
	e.declare()
	e.start(func(msg *message.Message) error {
		l.attempt(msg.UUID, middleware.Attempt(msg))
		if string(msg.Payload) == "slow" {
			slowRuns.Add(1)
			time.Sleep(4 * time.Second) // simulated slow work, past the 2 s consumer timeout
			return errTransient
		}
		l.success(msg.UUID)
		return nil
	})
	e.publish(slowPs...)
	e.publish(okPs...)
	all := append(append([]string{}, slowUUIDs...), okUUIDs...)
	settled := e.settle(len(all), l.handled, 120*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	acc := account(t, all, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	if poisoned[slowUUIDs[0]] != 1 || acc.Handled != len(okUUIDs) {
		t.Fatalf("slow message poisoned %d times, %d others handled", poisoned[slowUUIDs[0]], acc.Handled)
	}
	for _, d := range ds {
		t.Logf("slow message poisoned with class %v after %d runs (attempts %v)", d.Headers[middleware.ErrorClassKey], slowRuns.Load(), l.attemptsOf(slowUUIDs[0]))
	}
	if r := int(slowRuns.Load()); r > e.cfg.MaxAttempts {
		t.Errorf("slow message ran %d times, more than MaxAttempts %d", r, e.cfg.MaxAttempts)
	}
	if retries := e.depth(e.waitQueues()[0]); retries != 0 {
		t.Errorf("%d retry copies waiting", retries)
	}
}

// A quorum queue's delivery limit (RabbitMQ 4.0+ defaults to 20; any
// version honours x-delivery-limit): a message that reaches it (here: another
// consumer of Q rejects it with requeue, which counts on every version) is
// dead-lettered by RabbitMQ through Q's dead-letter exchange into Q's poison
// queue, with x-death reason delivery_limit: never dropped silently, never
// stranded in the retry path's dead-letter cycle detection.
func TestQuorumDeliveryLimitLandsInPoison(t *testing.T) {
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
		c.Subscriber.Queue.Arguments = map[string]any{"x-delivery-limit": int64(1)}
	})
	e.declare()
	uuids, ps := newMessages(1, nil)
	e.publish(ps...)
	ch := e.admin.channel()
	defer ch.Close()
	for i := 0; ; i++ {
		ok := poll(5*time.Second, func() bool {
			d, ok2, err := ch.Get(e.queue, false)
			if err != nil {
				t.Fatal(err)
			}
			if ok2 {
				_ = d.Reject(true)
			}
			return ok2
		})
		if !ok {
			break // dead-lettered
		}
		if i > 5 {
			t.Fatal("the delivery limit of 1 never removed the message")
		}
	}
	waitFor(t, 10*time.Second, "the message in the poison queue", func() bool { return e.poisonDepth() == 1 })
	poisoned, ds := e.poisoned()
	account(t, uuids, nil, poisoned)
	if r, _ := ds[0].Headers["x-first-death-reason"].(string); r != "delivery_limit" {
		t.Errorf("x-first-death-reason %q, want delivery_limit", r)
	}
	e.checkEmpty()
}

// A handler slower than the queue's consumer timeout that succeeds (issue
// 18, item 3): quorum queue with x-consumer-timeout 2 s, a 4 s handler that
// succeeds, 5 fast messages prefetched beside it. On RabbitMQ 4.x the broker
// cancels the consumer and returns every unacked delivery; the late acks
// are void. Must hold: no message whose handler succeeded is poisoned, the
// slow one runs at most MaxAttempts times, and the fast ones are not re-run
// for its sake.
func TestConsumerTimeoutSlowSuccess(t *testing.T) {
	if !brokerAtLeast4() {
		t.Skip("per-queue consumer timeout (x-consumer-timeout) and its cancel-without-close are RabbitMQ 4.x behaviour")
	}
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
		c.Subscriber.Queue.Arguments = map[string]any{"x-consumer-timeout": int64(2000)}
		c.Subscriber.Consume.Qos.PrefetchCount = 6
	})
	slowUUIDs, slowPs := newMessages(1, func(int) []byte { return []byte("slow") })
	okUUIDs, okPs := newMessages(5, nil)
	l := newLedger()
	runs := map[string]int{}
	var mu sync.Mutex
	var inflight atomic.Int32
	e.declare()
	e.start(func(msg *message.Message) error {
		inflight.Add(1)
		defer inflight.Add(-1)
		l.attempt(msg.UUID, middleware.Attempt(msg))
		mu.Lock()
		runs[msg.UUID]++
		mu.Unlock()
		if string(msg.Payload) == "slow" {
			time.Sleep(4 * time.Second) // simulated slow work, past the 2 s consumer timeout
		}
		l.success(msg.UUID)
		return nil
	})
	e.publish(slowPs...)
	e.publish(okPs...)
	all := append(append([]string{}, slowUUIDs...), okUUIDs...)
	// Settled: everything handled or poisoned, no handler running (a slow
	// run holds its message unacked, not ready), stable for the window.
	settled := e.settle(len(all), func() int {
		if inflight.Load() > 0 {
			return 0
		}
		return l.handled()
	}, 90*time.Second)
	e.stop()
	poisoned, _ := e.poisoned()
	acc := account(t, all, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("slow message ran %d times (attempts %v); fast runs %v", runs[slowUUIDs[0]], l.attemptsOf(slowUUIDs[0]), runs)
	for u, n := range poisoned {
		if l.successes()[u] > 0 {
			t.Errorf("%s succeeded and was poisoned %d times", u, n)
		}
	}
	if r := runs[slowUUIDs[0]]; r > e.cfg.MaxAttempts {
		t.Errorf("slow message ran %d times, more than MaxAttempts %d", r, e.cfg.MaxAttempts)
	}
	extra := 0
	for _, u := range okUUIDs {
		extra += runs[u] - 1
	}
	if extra != 0 {
		t.Errorf("the fast messages ran %d extra times", extra)
	}
	if acc.Handled != len(all) {
		t.Errorf("%d of %d handled", acc.Handled, len(all))
	}
}

// A handler slower than the queue's consumer timeout that honours its
// context (issue 18, item 3, the handler deadline): quorum queue with a
// consumer timeout of 5 s (queue argument, or a policy read through the
// management API), a handler that takes 8 s unless its context ends first,
// 5 fast messages prefetched behind it (also with the consumer's own
// x-consumer-timeout on basic.consume). The chain's deadline (5 s minus the
// 1 s margin) ends the slow run as a counted transient failure: its retry
// copy is confirmed and the original acked before the broker's timeout, so
// the broker never takes a delivery back. Must hold: no message whose
// handler succeeded is poisoned; the slow message runs at most MaxAttempts
// times, at attempts 1, 2, 3 (every overrun counted); the fast ones run
// once; the consumer is never cancelled.
func TestConsumerTimeoutHandlerDeadline(t *testing.T) {
	if !brokerAtLeast43() {
		t.Skip("the consumer timeout by queue argument or policy, with basic.cancel instead of a channel close, is RabbitMQ 4.3 quorum-queue behaviour")
	}
	for _, tc := range []struct {
		name       string
		policy     bool // the timeout comes from a policy, not a queue argument
		consumer   bool // the timeout comes from basic.consume's x-consumer-timeout
		slowRuns   int  // how many runs of the slow message are slow
		wantRuns   int
		wantPoison int
	}{
		{name: "argument/always-slow", slowRuns: 1 << 30, wantRuns: 3, wantPoison: 1},
		{name: "argument/slow-once", slowRuns: 1, wantRuns: 2, wantPoison: 0},
		{name: "policy/slow-once", policy: true, slowRuns: 1, wantRuns: 2, wantPoison: 0},
		{name: "consumer-argument/slow-once", consumer: true, slowRuns: 1, wantRuns: 2, wantPoison: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var base string
			if tc.policy {
				base = testkit.HaveMgmt(t)
			}
			e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
				switch {
				case tc.policy:
					c.ManagementURL = base
				case tc.consumer:
					c.Subscriber.Consume.Arguments = map[string]any{"x-consumer-timeout": int64(5000)}
				default:
					c.Subscriber.Queue.Arguments = map[string]any{"x-consumer-timeout": int64(5000)}
				}
				c.Subscriber.Consume.Qos.PrefetchCount = 8
				c.MaxAttempts = 3
				c.HandlerDeadline.HandlerTimeout = 10 * time.Second // for the warning
			})
			if tc.policy {
				// Set before the queue exists, so that the deadline is
				// known from the first declare.
				name := e.prefix + ".consumer-timeout"
				putPolicy(t, base, name, "^"+regexp.QuoteMeta(e.queue)+"$", 50, map[string]any{"consumer-timeout": 5000})
				e.declare()
				awaitPolicy(t, base, e.queue, name)
			} else {
				e.declare()
			}
			slowUUIDs, slowPs := newMessages(1, func(int) []byte { return []byte("slow") })
			okUUIDs, okPs := newMessages(5, nil)
			l := newLedger()
			runs := map[string]int{}
			var mu sync.Mutex
			var inflight atomic.Int32
			e.start(func(msg *message.Message) error {
				inflight.Add(1)
				defer inflight.Add(-1)
				l.attempt(msg.UUID, middleware.Attempt(msg))
				mu.Lock()
				runs[msg.UUID]++
				n := runs[msg.UUID]
				mu.Unlock()
				if string(msg.Payload) == "slow" && n <= tc.slowRuns {
					select {
					case <-time.After(8 * time.Second): // slow work, past the 5 s consumer timeout
					case <-msg.Context().Done():
						return msg.Context().Err()
					}
				}
				l.success(msg.UUID)
				return nil
			})
			e.publish(slowPs...)
			e.publish(okPs...)
			all := append(append([]string{}, slowUUIDs...), okUUIDs...)
			settled := e.settle(len(all), func() int {
				if inflight.Load() > 0 {
					return 0
				}
				return l.handled()
			}, 120*time.Second)
			e.stop()
			poisoned, _ := e.poisoned()
			acc := account(t, all, l.successes(), poisoned)
			if !settled {
				t.Errorf("did not settle")
			}
			e.checkEmpty()
			mu.Lock()
			defer mu.Unlock()
			slow := slowUUIDs[0]
			t.Logf("slow message ran %d times (attempts %v); runs %v", runs[slow], l.attemptsOf(slow), runs)
			for u, n := range poisoned {
				if l.successes()[u] > 0 {
					t.Errorf("%s succeeded and was poisoned %d times", u, n)
				}
			}
			if r := runs[slow]; r != tc.wantRuns {
				t.Errorf("slow message ran %d times, want %d (MaxAttempts %d)", r, tc.wantRuns, e.cfg.MaxAttempts)
			}
			if got, want := l.attemptsOf(slow), []int{1, 2, 3}[:tc.wantRuns]; !slices.Equal(got, want) {
				t.Errorf("slow message ran at attempts %v, want %v (every overrun counted)", got, want)
			}
			extra := 0
			for _, u := range okUUIDs {
				extra += runs[u] - 1
			}
			if extra != 0 {
				t.Errorf("the fast messages ran %d extra times", extra)
			}
			if acc.Poisoned != tc.wantPoison || acc.Handled != len(all)-tc.wantPoison || acc.Duplicates != 0 {
				t.Errorf("account %+v, want %d handled, %d poisoned, 0 duplicates", acc, len(all)-tc.wantPoison, tc.wantPoison)
			}
			if n := len(e.logs.find("", "took its delivery back")) + len(e.logs.find("", "delivery was taken back")); n != 0 {
				t.Errorf("%d log lines say the broker took a delivery back; the deadline should have come first", n)
			}
			if len(e.logs.find("info", "Handler overran its deadline")) != runs[slow]-boolInt(tc.wantPoison == 0) {
				t.Errorf("overrun log lines %d, want one per slow run", len(e.logs.find("info", "Handler overran its deadline")))
			}
			derived := e.logs.find("info", "Handler deadline derived")
			if len(derived) == 0 || derived[len(derived)-1].Fields["handler_deadline"] != "4s" {
				t.Errorf("derived deadline logs %+v, want handler_deadline 4s", derived)
			} else {
				t.Logf("deadline: %v", derived[len(derived)-1].Fields)
			}
			if w := e.logs.find("error", "Configured handler timeout exceeds"); len(w) == 0 {
				t.Errorf("no warning that HandlerTimeout 10s exceeds the 4s deadline")
			}
			if w := e.logs.find("", "cannot be determined"); len(w) != 0 {
				t.Errorf("the consumer timeout was known, yet: %v", w[0].Fields)
			}
		})
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
