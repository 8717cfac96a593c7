package faults

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// mgmtDo sends a management API request with a JSON body (nil: none).
func mgmtDo(t *testing.T, base, method, path string, body any) {
	t.Helper()
	var rd *bytes.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	} else {
		rd = bytes.NewReader(nil)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(base, "/")+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode >= 300 && !(method == http.MethodDelete && resp.StatusCode == http.StatusNotFound) {
		t.Fatalf("%s %s: %s", method, path, resp.Status)
	}
}

// putPolicy sets an operator's policy on the default vhost, removed when the
// test ends.
func putPolicy(t *testing.T, base, name, pattern string, priority int, def map[string]any) {
	t.Helper()
	path := "/api/policies/%2F/" + url.PathEscape(name)
	mgmtDo(t, base, http.MethodPut, path, map[string]any{"pattern": pattern, "apply-to": "queues", "priority": priority, "definition": def})
	t.Cleanup(func() { mgmtDo(t, base, http.MethodDelete, path, nil) })
}

// awaitPolicy waits until the management API reports policy (""
// for none) on queue q: the broker applies policies asynchronously. The
// queue record (disable_stats, 4.x) shows it at once; where that view has
// no policy field (3.10) the statistics view does, within its interval
// (5 s).
func awaitPolicy(t *testing.T, base, q, policy string) {
	t.Helper()
	path := "/api/queues/%2F/" + url.PathEscape(q)
	testkit.WaitFor(t, 30*time.Second, "policy "+policy+" on "+q, func() bool {
		var mq map[string]any
		if !mgmtGet(t, base, path+"?disable_stats=true", &mq) {
			return false
		}
		if _, ok := mq["policy"]; !ok && !mgmtGet(t, base, path, &mq) {
			return false
		}
		got, _ := mq["policy"].(string)
		return got == policy
	})
}

// timedLedger records when each attempt of each message ran.
type timedLedger struct {
	*ledger
	mu    sync.Mutex
	times map[string][]time.Time
}

func newTimedLedger() *timedLedger {
	return &timedLedger{ledger: newLedger(), times: map[string][]time.Time{}}
}

// failOnce fails each message's first attempt and succeeds afterwards.
func (l *timedLedger) failOnce(msg *message.Message) error {
	l.mu.Lock()
	l.times[msg.UUID] = append(l.times[msg.UUID], time.Now())
	l.mu.Unlock()
	a := middleware.Attempt(msg)
	l.attempt(msg.UUID, a)
	if a <= 1 {
		return errTransient
	}
	l.success(msg.UUID)
	return nil
}

// earliestGap returns the shortest time between a message's first and
// second attempt, over all messages that ran twice, and how many did.
func (l *timedLedger) earliestGap() (time.Duration, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var gap time.Duration
	n := 0
	for _, ts := range l.times {
		if len(ts) < 2 {
			continue
		}
		if d := ts[1].Sub(ts[0]); n == 0 || d < gap {
			gap = d
		}
		n++
	}
	return gap, n
}

// Issue 18 item 6: DeadLetterFirstRetry (and NativeDelayedRetry) on an
// adopted queue get their route from the library's policy. An operator
// then adds a policy of higher priority for the queue (without the
// library's keys), or deletes the library's policy: before, every later
// first retry was a nack with no dead-letter target (200 of 200 lost), and
// a native retry came back at once instead of after its delay. Now the
// Delayer checks the policy that applies before relying on the nack
// (cached 2 s) and takes the publish path while it is not the library's:
// lost 0, no retry earlier than the first tier, a logged error.
func TestAdoptPolicyDrift(t *testing.T) {
	requireLong(t)
	mgmt := testkit.HaveMgmt(t)
	type mode struct {
		name   string
		native bool
	}
	modes := []mode{{"dead-letter-first", false}}
	if brokerAtLeast43() {
		modes = append(modes, mode{"native", true})
	}
	for _, m := range modes {
		for _, drift := range []string{"higher-priority-policy", "policy-deleted"} {
			t.Run(m.name+"/"+drift, func(t *testing.T) {
				e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
					c.MaxAttempts = 3
					c.AdoptQueue = &amqpretry.AdoptQueue{ManagementURL: mgmt}
					if m.native {
						c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: 200 * time.Millisecond, Tiers: envTiers})
					} else {
						c.Mode = amqpretry.DeadLetterFirst(envTiers...)
					}
				})
				deletePolicyAtCleanup(t, mgmt, e.queue)
				l := newTimedLedger()
				e.start(l.failOnce) // declares Q and applies the library's policy
				ours := amqpretry.PolicyNamePrefix + e.queue
				awaitPolicy(t, mgmt, e.queue, ours)

				// The operator's change, before any retry ran.
				want := ""
				if drift == "higher-priority-policy" {
					want = e.prefix + ".operator"
					putPolicy(t, mgmt, want, "^"+strings.ReplaceAll(e.queue, ".", `\.`)+"$", 100, map[string]any{"max-length": 1_000_000})
				} else {
					mgmtDo(t, mgmt, http.MethodDelete, "/api/policies/%2F/"+url.PathEscape(ours), nil)
				}
				awaitPolicy(t, mgmt, e.queue, want)

				const n = 200
				uuids, ps := newMessages(n, nil)
				e.publish(ps...)
				settled := e.settle(n, l.handled, time.Minute)
				e.stop()
				poisoned, _ := e.poisoned()
				acc := account(t, uuids, l.successes(), poisoned)
				if !settled {
					t.Errorf("messages did not settle within 1 min")
				}
				if acc.Handled != n {
					t.Errorf("handled %d of %d (each fails once, MaxAttempts 3)", acc.Handled, n)
				}
				first := e.retry.Topology().Tiers()[0]
				gap, ran := l.earliestGap()
				t.Logf("%d messages retried; earliest retry %v after the failure (first tier %v)", ran, gap.Round(time.Millisecond), first)
				if ran > 0 && gap < first {
					t.Errorf("a retry ran %v after its failure, earlier than the first tier %v", gap, first)
				}
				if len(e.logs.find("error", "route not in place")) == 0 {
					t.Errorf("the drift was not logged")
				}
			})
		}
	}
}

// Issue 18 item 7: DeadLetterFirstRetry's first wait queue refuses the
// dead-lettered originals: an operator caps it (policy max-length 10,
// overflow reject-publish), or deletes it. Before, quorum at-least-once
// dead-lettering kept most first retries unseen in Q's dead-letter buffer
// for over a minute. Now the Delayer checks the first wait queue (exists;
// with a management API, no length limit) before relying on the nack and
// takes the publish path otherwise (a refused copy goes through the
// fallback): every message is back and handled within the publish path's
// time, lost 0.
func TestDeadLetterFirstWaitQueueRefuses(t *testing.T) {
	requireLong(t)
	for _, refusal := range []string{"capped", "deleted"} {
		t.Run(refusal, func(t *testing.T) {
			mgmt := ""
			if refusal == "capped" {
				mgmt = testkit.HaveMgmt(t)
			}
			e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
				c.MaxAttempts = 3
				c.Mode = amqpretry.DeadLetterFirst(envTiers...)
				c.ManagementURL = mgmt
			})
			l := newTimedLedger()
			e.start(l.failOnce)
			wq := e.waitQueues()[0]
			if refusal == "capped" {
				name := e.prefix + ".cap"
				putPolicy(t, mgmt, name, "^"+strings.ReplaceAll(wq, ".", `\.`)+"$", 100, map[string]any{"max-length": 10, "overflow": "reject-publish"})
				awaitPolicy(t, mgmt, wq, name)
			} else {
				ch := e.admin.channel()
				if _, err := ch.QueueDelete(wq, false, false, false); err != nil {
					t.Fatal(err)
				}
				_ = ch.Close()
			}

			const n = 100
			uuids, ps := newMessages(n, nil)
			start := time.Now()
			e.publish(ps...)
			settled := e.settle(n, l.handled, 45*time.Second)
			took := time.Since(start)
			e.stop()
			poisoned, _ := e.poisoned()
			acc := account(t, uuids, l.successes(), poisoned)
			t.Logf("all %d handled in %v", acc.Handled, took.Round(time.Millisecond))
			if !settled || acc.Handled != n {
				t.Errorf("handled %d of %d within 45 s (settled %v)", acc.Handled, n, settled)
			}
			gap, ran := l.earliestGap()
			if first := e.retry.Topology().Tiers()[0]; ran > 0 && gap < first {
				t.Errorf("a retry ran %v after its failure, earlier than the first tier %v", gap, first)
			}
		})
	}
}

// Issue 18 item 8: the wait queues refuse every copy (an operator's policy
// max-length 0, overflow reject-publish), so each retry goes through the
// fallback, whose copy goes straight back to the queue. The handler asks
// for RetryAfter 1.5 s on the first attempt; before, the fallback's 1 s
// pause brought the message back up to 0.5 s early. Now no second attempt
// runs earlier than 1.5 s after the first failed.
func TestFallbackNeverEarlierThanRetryAfter(t *testing.T) {
	requireLong(t)
	mgmt := testkit.HaveMgmt(t)
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt, func(_ *env, c *amqpretry.Config) {
			c.MaxAttempts = 3
			c.Mode = amqpretry.Tiers(200*time.Millisecond, 2*time.Second)
		})
		e.declare()
		var pattern []string
		for _, wq := range e.waitQueues() {
			pattern = append(pattern, strings.ReplaceAll(wq, ".", `\.`))
		}
		pol := e.prefix + ".full"
		putPolicy(t, mgmt, pol, "^("+strings.Join(pattern, "|")+")$", 100, map[string]any{"max-length": 0, "overflow": "reject-publish"})
		for _, wq := range e.waitQueues() {
			awaitPolicy(t, mgmt, wq, pol)
		}
		const asked = 1500 * time.Millisecond
		l := newTimedLedger()
		e.start(func(msg *message.Message) error {
			if err := l.failOnce(msg); err != nil {
				return middleware.RetryAfter(err, asked)
			}
			return nil
		})
		const n = 6
		uuids, ps := newMessages(n, nil)
		e.publish(ps...)
		settled := e.settle(n, l.handled, time.Minute)
		e.stop()
		poisoned, _ := e.poisoned()
		acc := account(t, uuids, l.successes(), poisoned)
		if !settled || acc.Handled != n {
			t.Errorf("handled %d of %d (settled %v)", acc.Handled, n, settled)
		}
		gap, ran := l.earliestGap()
		t.Logf("%d retried through the fallback; earliest second attempt %v after the first (asked %v)", ran, gap.Round(time.Millisecond), asked)
		if ran != n || gap < asked {
			t.Errorf("%d of %d retried; earliest %v after the failure, asked %v", ran, n, gap, asked)
		}
		if len(e.logs.find("info", "Fallback copy held")) == 0 {
			t.Errorf("no retry went through the fallback")
		}
	})
}
