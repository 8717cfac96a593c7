package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
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
		if d := e.depth(e.retry.Topology().Naming().PoisonQueue(qa)); d != 0 {
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

// poisoned returns the poison queue's messages, acked.
func (e *testEnv) poisoned(q string) []amqp.Delivery {
	return e.drain(e.retry.Topology().Naming().PoisonQueue(q))
}

// A permanent error goes to the poison queue at once with its metadata; a
// transient error that never clears lands there after exactly MaxAttempts.
func TestE2E_PoisonPermanentAndExhausted(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt)
		rec := newRecorder()
		perm := message.NewMessage(watermill.NewUUID(), []byte("perm"))
		trans := message.NewMessage(watermill.NewUUID(), []byte("trans"))
		q := e.handle("svc", func(msg *message.Message) error {
			rec.record(msg, middleware.Attempt(msg))
			if msg.UUID == perm.UUID {
				return middleware.Permanent(errors.New("order references unknown customer"))
			}
			return errTransient
		})
		e.start()
		start := time.Now()
		e.publish(perm, trans)
		pq := e.retry.Topology().Naming().PoisonQueue(q)
		waitFor(t, 15*time.Second, "2 poisoned messages", func() bool { return e.depth(pq) == 2 })
		e.stopRouter()
		if got, _ := rec.get(perm.UUID); len(got) != 1 {
			t.Errorf("permanent error: %d attempts, want 1", len(got))
		}
		if got, _ := rec.get(trans.UUID); fmt.Sprint(got) != "[1 2 3]" {
			t.Errorf("transient error: attempts %v, want [1 2 3]", got)
		}
		byUUID := map[string]amqp.Delivery{}
		for _, d := range e.poisoned(q) {
			byUUID[d.Headers["_watermill_message_uuid"].(string)] = d
		}
		check := func(uuid, class, attempts, reason string) {
			d, ok := byUUID[uuid]
			if !ok {
				t.Fatalf("message %s not in poison queue", uuid)
			}
			h := func(k string) string { s, _ := d.Headers[k].(string); return s }
			if h(middleware.PoisonAttemptsKey) != attempts || h(middleware.ErrorClassKey) != class {
				t.Errorf("%s: attempts %q class %q, want %s %s", uuid, h(middleware.PoisonAttemptsKey), h(middleware.ErrorClassKey), attempts, class)
			}
			if !strings.Contains(h(retrymeta.PoisonReasonKey), reason) {
				t.Errorf("%s: reason %q does not contain %q", uuid, h(retrymeta.PoisonReasonKey), reason)
			}
			if h(retrymeta.PoisonTopicKey) != q || h(retrymeta.PoisonHandlerKey) != "svc" || h(retrymeta.PoisonSubscriberKey) == "" {
				t.Errorf("%s: watermill poison keys wrong: topic %q handler %q subscriber %q", uuid, h(retrymeta.PoisonTopicKey), h(retrymeta.PoisonHandlerKey), h(retrymeta.PoisonSubscriberKey))
			}
			if h(middleware.OriginalQueueKey) != q || h(middleware.OriginalExchangeKey) != e.exchange || h(middleware.OriginalRoutingKeyKey) != "order.created" {
				t.Errorf("%s: origin %q %q %q", uuid, h(middleware.OriginalQueueKey), h(middleware.OriginalExchangeKey), h(middleware.OriginalRoutingKeyKey))
			}
			first, err1 := time.Parse(time.RFC3339Nano, h(middleware.FirstFailureKey))
			last, err2 := time.Parse(time.RFC3339Nano, h(middleware.LastFailureKey))
			if err1 != nil || err2 != nil || first.Before(start.Add(-time.Second)) || last.Before(first) {
				t.Errorf("%s: failure times first %q last %q", uuid, h(middleware.FirstFailureKey), h(middleware.LastFailureKey))
			}
			for k := range d.Headers {
				// A quorum queue sets x-delivery-count on the delivery itself.
				if strings.HasPrefix(k, "x-") && k != "x-delivery-count" {
					t.Errorf("%s: broker header %s carried into the poison queue", uuid, k)
				}
			}
		}
		check(perm.UUID, middleware.ClassPermanent, "1", "unknown customer")
		check(trans.UUID, middleware.ClassExhausted, "3", "dependency unavailable")
		e.waitQueuesEmpty(q, 5*time.Second)
	})
}

// 1,000 messages with random transient and permanent failures: every message
// ends handled or poisoned, the counts add up, the wait queues end empty.
func TestE2E_ThousandMessagesAccounting(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt)
		const n = 1000
		rng := rand.New(rand.NewPCG(1, 2))
		type plan struct {
			failures  int // transient failures before success
			permanent bool
		}
		plans := map[string]plan{}
		msgs := make([]*message.Message, n)
		wantOK, wantPoison := 0, 0
		for i := range msgs {
			m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
			p := plan{failures: rng.IntN(5), permanent: rng.IntN(10) == 0}
			if p.permanent || p.failures >= 3 { // MaxAttempts 3
				wantPoison++
			} else {
				wantOK++
			}
			plans[m.UUID] = p
			msgs[i] = m
		}
		var mu sync.Mutex
		handled := map[string]int{}
		seen := map[string]int{}
		q := e.handle("svc", func(msg *message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			p, ok := plans[msg.UUID]
			if !ok {
				return middleware.Permanent(fmt.Errorf("unknown message %s", msg.UUID))
			}
			seen[msg.UUID]++
			if p.permanent {
				return middleware.Permanent(errors.New("bad order"))
			}
			if middleware.Attempt(msg) <= p.failures {
				return errTransient
			}
			handled[msg.UUID]++
			return nil
		})
		e.start()
		e.publish(msgs...)
		pq := e.retry.Topology().Naming().PoisonQueue(q)
		waitFor(t, 60*time.Second, "every message handled or poisoned", func() bool {
			mu.Lock()
			h := len(handled)
			mu.Unlock()
			return h == wantOK && e.depth(pq) == wantPoison
		})
		e.stopRouter()
		e.waitQueuesEmpty(q, 5*time.Second)
		poisonedUUIDs := map[string]int{}
		for _, d := range e.poisoned(q) {
			poisonedUUIDs[d.Headers["_watermill_message_uuid"].(string)]++
		}
		var ok, poisoned, dup, lost int
		for uuid, p := range plans {
			h, pz := handled[uuid], poisonedUUIDs[uuid]
			switch {
			case h == 0 && pz == 0:
				lost++
			case h > 0 && pz > 0:
				t.Errorf("%s both handled and poisoned", uuid)
			}
			if h > 1 || pz > 1 {
				dup++
			}
			if h > 0 {
				ok++
			}
			if pz > 0 {
				poisoned++
				wantAttempts := 3
				if p.permanent {
					wantAttempts = 1
				}
				if seen[uuid] != wantAttempts {
					t.Errorf("%s poisoned after %d attempts, want %d", uuid, seen[uuid], wantAttempts)
				}
			}
		}
		t.Logf("published %d: handled %d, poisoned %d, duplicates %d, lost %d", n, ok, poisoned, dup, lost)
		if ok != wantOK || poisoned != wantPoison || lost != 0 || ok+poisoned != n {
			t.Fatalf("accounting: handled %d (want %d), poisoned %d (want %d), lost %d", ok, wantOK, poisoned, wantPoison, lost)
		}
		if e.depth(q) != 0 {
			t.Fatalf("queue %s not empty", q)
		}
	})
}

// A wait queue that refuses the retry copy (a max-length policy with
// overflow reject-publish: the broker nacks the publish) must not lose the
// message. The fallback pauses, then publishes the copy straight back to Q
// (confirmed), counted as the next attempt; it never relies on Q's
// dead-lettering, which classic queues do at most once.
//
// Classic queues only: a quorum queue with reject-publish still accepts a
// publish while its length is under the limit, so max-length 0 does not make
// it refuse (RabbitMQ 3.10, "Quorum Queues": overflow is checked after the
// fact); the quorum refusal path is exercised by faults/refuse_test.go.
func TestE2E_WaitQueueRefusesRetries(t *testing.T) {
	t.Run("classic", func(t *testing.T) {
		const qt = amqpretry.QueueTypeClassic
		const pause = 300 * time.Millisecond
		e := newEnv(t, qt, func(c *amqpretry.Config) { c.FallbackPause = pause })
		rec := newRecorder()
		q := e.handle("svc", func(msg *message.Message) error {
			rec.record(msg, middleware.Attempt(msg))
			if middleware.Attempt(msg) < 3 {
				return errTransient
			}
			return nil
		})
		refuseWaitQueues(t, q)
		e.start()
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		e.publish(msg)
		waitFor(t, 15*time.Second, "3 attempts through the fallback", func() bool { return rec.count(msg.UUID) == 3 })
		attempts, times := rec.get(msg.UUID)
		if fmt.Sprint(attempts) != "[1 2 3]" {
			t.Fatalf("attempts %v, want [1 2 3]", attempts)
		}
		for i := 1; i < 3; i++ {
			if gap := times[i].Sub(times[i-1]); gap < pause {
				t.Errorf("fallback retry %d came after %v, before the pause %v (hot loop?)", i, gap, pause)
			}
		}
		for _, wq := range e.retry.Topology().WaitQueues(q) {
			if d := e.depth(wq); d != 0 {
				t.Errorf("wait queue %s holds %d", wq, d)
			}
		}
		waitFor(t, 5*time.Second, "Q empty", func() bool { return e.depth(q) == 0 })
	})
}

// refuseWaitQueues applies a policy making q's wait queues refuse every
// publish (max-length 0, overflow reject-publish: the broker nacks it), and
// removes it at the end of the test.
func refuseWaitQueues(t *testing.T, q string) {
	t.Helper()
	testkit.HaveCtl(t)
	name := "refuse." + q
	pattern := "^" + regexp.QuoteMeta(q) + `\.wait\.`
	if out, err := testkit.Ctl(t, 30*time.Second, "set_policy", "--apply-to", "queues", "--priority", "100",
		name, pattern, `{"max-length":0,"overflow":"reject-publish"}`); err != nil {
		t.Fatalf("set_policy: %v: %s", err, out)
	}
	t.Cleanup(func() { _, _ = testkit.Ctl(t, 30*time.Second, "clear_policy", name) })
}

// Messages carrying x-death and x-delivery-count headers (non-string AMQP
// values that watermill-amqp's DefaultMarshaler refuses) unmarshal and are
// handled; x-death rejections of this queue written by the producer do not
// count (only the broker's, on a delivery back through a retry route).
func TestE2E_BrokerHeadersUnmarshal(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt)
		rec := newRecorder()
		q := e.handle("svc", func(msg *message.Message) error {
			rec.record(msg, middleware.Attempt(msg))
			return nil
		})
		e.start()
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		p, err := amqpretry.Marshaler{}.Marshal(msg)
		if err != nil {
			t.Fatal(err)
		}
		p.Headers["x-death"] = []interface{}{
			amqp.Table{"queue": q, "reason": "rejected", "count": int64(1), "exchange": e.exchange,
				"routing-keys": []interface{}{"order.created"}, "time": time.Now().Truncate(time.Second)},
			amqp.Table{"queue": "elsewhere", "reason": "expired", "count": int64(4)},
		}
		p.Headers["x-delivery-count"] = int64(2)
		p.Headers["x-first-death-queue"] = q
		p.Headers["an-int"] = int32(7)
		if err := e.ch.PublishWithContext(context.Background(), e.exchange, "order.created", false, false, p); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "message handled", func() bool { return rec.count(msg.UUID) == 1 })
		rec.mu.Lock()
		md := rec.meta[msg.UUID][0]
		att := rec.attempts[msg.UUID][0]
		rec.mu.Unlock()
		if att != 1 {
			t.Errorf("attempt %d, want 1 (a producer's x-death never counts on a first delivery)", att)
		}
		if md.Get("x-delivery-count") != "2" || md.Get("an-int") != "7" {
			t.Errorf("metadata x-delivery-count %q an-int %q", md.Get("x-delivery-count"), md.Get("an-int"))
		}
		if deaths, err := amqpwire.ParseXDeath(md.Get(middleware.XDeathKey)); err != nil || len(deaths) != 2 {
			t.Errorf("x-death metadata %q: %v", md.Get(middleware.XDeathKey), err)
		}
		if e.depth(q) != 0 {
			t.Error("message left in queue")
		}
	})
}

// A message in a long tier does not delay one in a short tier: one wait queue
// per tier, no per-message TTL at the head of a shared queue.
func TestE2E_NoHeadOfLineBlocking(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt, func(c *amqpretry.Config) { c.Mode = amqpretry.Tiers(200*time.Millisecond, 5*time.Second) })
		rec := newRecorder()
		long := message.NewMessage(watermill.NewUUID(), []byte("long"))
		short := message.NewMessage(watermill.NewUUID(), []byte("short"))
		e.handle("svc", func(msg *message.Message) error {
			rec.record(msg, middleware.Attempt(msg))
			if middleware.Attempt(msg) > 1 {
				return nil
			}
			if msg.UUID == long.UUID {
				return middleware.RetryAfter(errTransient, 5*time.Second)
			}
			return errTransient
		})
		e.start()
		e.publish(long)
		waitFor(t, 5*time.Second, "long message's first attempt", func() bool { return rec.count(long.UUID) == 1 })
		e.publish(short)
		waitFor(t, 5*time.Second, "short message's retry", func() bool { return rec.count(short.UUID) == 2 })
		_, st := rec.get(short.UUID)
		if gap := st[1].Sub(st[0]); gap < 200*time.Millisecond || gap > 2*time.Second {
			t.Errorf("short-tier retry took %v, want 200ms..2s", gap)
		}
		if rec.count(long.UUID) != 1 {
			t.Errorf("long-tier message came back before the short one")
		}
		waitFor(t, 10*time.Second, "long message's retry", func() bool { return rec.count(long.UUID) == 2 })
		_, lt := rec.get(long.UUID)
		if gap := lt[1].Sub(lt[0]); gap < 5*time.Second {
			t.Errorf("long-tier retry came after %v, before its 5s tier", gap)
		}
	})
}

// Issue #18 item 1: a message's first run through this queue always runs
// the handler. Whatever attempt evidence a producer or another queue's chain
// put on it (the library's attempt header at any value, malformed or
// huge, an x-death count for this queue, another chain's origin and
// redelivery keys), the first delivery is attempt 1, and the message runs
// exactly MaxAttempts (3) times, its retry copies carrying this queue's own
// count, then lands in the poison queue.
func TestE2E_ForgedRetryHeaders(t *testing.T) {
	for _, mode := range []struct {
		name string
		qt   string
		opts []envOption
	}{
		{"classic", amqpretry.QueueTypeClassic, nil},
		{"quorum", amqpretry.QueueTypeQuorum, nil},
		{"quorum-dead-letter-first", amqpretry.QueueTypeQuorum, []envOption{func(c *amqpretry.Config) { c.Mode = amqpretry.DeadLetterFirst() }}},
		{"quorum-native", amqpretry.QueueTypeQuorum, []envOption{func(c *amqpretry.Config) {
			c.Backoff = testkit.ExactBackoff(200 * time.Millisecond) // 200 ms, 400 ms: both native
			c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: 200 * time.Millisecond, Max: 400 * time.Millisecond})
		}}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			if mode.name == "quorum-native" {
				broker43(t)
			}
			forgedRetryHeaders(t, mode.name, mode.qt, mode.opts...)
		})
	}
}

func forgedRetryHeaders(t *testing.T, mode, qt string, opts ...envOption) {
	{
		e := newEnv(t, qt, opts...)
		rec := newRecorder()
		q := e.handle("svc", func(msg *message.Message) error {
			rec.record(msg, middleware.Attempt(msg))
			return errTransient
		})
		e.start()
		type forged struct {
			name    string
			headers amqp.Table
		}
		cases := []forged{
			{"attempt abc", amqp.Table{middleware.AttemptKey: "abc"}},
			{"attempt -5", amqp.Table{middleware.AttemptKey: "-5"}},
			{"attempt 0", amqp.Table{middleware.AttemptKey: "0"}},
			{"attempt 2", amqp.Table{middleware.AttemptKey: "2"}},
			{"attempt = MaxAttempts", amqp.Table{middleware.AttemptKey: "3"}},
			{"attempt 99", amqp.Table{middleware.AttemptKey: "99"}},
			{"attempt overflow", amqp.Table{middleware.AttemptKey: "99999999999999999999"}},
			{"x-death 50 for Q", amqp.Table{"x-death": []interface{}{
				amqp.Table{"queue": q, "reason": "rejected", "count": int64(50), "exchange": e.exchange,
					"routing-keys": []interface{}{"order.created"}, "time": time.Now().Truncate(time.Second)},
				amqp.Table{"queue": q + ".wait.1s", "reason": "expired", "count": int64(50)},
			}}},
			{"another queue's chain", amqp.Table{middleware.AttemptKey: "3", middleware.OriginalQueueKey: "payments",
				retrymeta.RedeliveriesKey: "2", retrymeta.DeliveryRetryPathKey: "true", retrymeta.DeliveryRetryRouteKey: "true",
				middleware.FirstFailureKey: "2026-01-01T00:00:00Z", "x-acquired-count": int64(7), "x-delivery-count": int64(7)}},
		}
		uuids := map[string]string{}
		for _, c := range cases {
			m := message.NewMessage(watermill.NewUUID(), []byte(c.name))
			p, err := amqpretry.Marshaler{}.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			for k, v := range c.headers {
				p.Headers[k] = v
			}
			if err := e.ch.PublishWithContext(context.Background(), e.exchange, "order.created", false, false, p); err != nil {
				t.Fatal(err)
			}
			uuids[c.name] = m.UUID
		}
		pq := e.retry.Topology().Naming().PoisonQueue(q)
		waitFor(t, 30*time.Second, "all forged messages poisoned", func() bool { return e.depth(pq) == len(cases) })
		runs := 0
		for _, c := range cases {
			got, _ := rec.get(uuids[c.name])
			runs += len(got)
			if fmt.Sprint(got) != "[1 2 3]" {
				t.Errorf("%s: runs at attempts %v, want [1 2 3]", c.name, got)
			}
		}
		// handled: messages that succeeded (none: the handler always fails);
		// every message ends poisoned, after exactly 3 runs.
		t.Logf("ACCOUNT TestE2E_ForgedRetryHeaders/%s: published=%d handled=0 poisoned=%d duplicates=0 lost=%d (handler runs %d)",
			mode, len(cases), e.depth(pq), len(cases)-e.depth(pq)-e.depth(q), runs)
	}
}

// DeadLetterFirstRetry (quorum): a first-tier retry is the broker's
// dead-letter path (nack → Q's DLX → first wait queue → back to Q only),
// counted from x-death; later tiers are published copies. Attempts 1, 2, 3,
// each no earlier than its tier; the other queue sees the message once.
func TestE2E_DeadLetterFirstRetry(t *testing.T) {
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) { c.Mode = amqpretry.DeadLetterFirst() })
	recA, recB := newRecorder(), newRecorder()
	qa := e.handle("a", func(msg *message.Message) error {
		n := middleware.Attempt(msg)
		recA.record(msg, n)
		if n < 3 {
			return errTransient
		}
		return nil
	})
	e.handle("b", func(msg *message.Message) error { recB.record(msg, 1); return nil })
	e.start()
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	e.publish(msg)
	waitFor(t, 15*time.Second, "3 attempts on A", func() bool { return recA.count(msg.UUID) == 3 })
	attempts, times := recA.get(msg.UUID)
	if fmt.Sprint(attempts) != "[1 2 3]" {
		t.Fatalf("attempts %v, want [1 2 3]", attempts)
	}
	tiers := e.retry.Topology().Tiers()
	for i := 1; i < 3; i++ {
		if gap := times[i].Sub(times[i-1]); gap < tiers[i-1] {
			t.Errorf("attempt %d came %v after attempt %d, earlier than its tier %v", i+1, gap, i, tiers[i-1])
		}
	}
	recA.mu.Lock()
	second := recA.meta[msg.UUID][1]
	recA.mu.Unlock()
	deaths, err := amqpwire.ParseXDeath(second.Get(middleware.XDeathKey))
	if err != nil || len(deaths) == 0 || deaths[0].Queue == "" {
		t.Fatalf("second attempt should carry x-death from the dead-letter hop: %q %v", second.Get(middleware.XDeathKey), err)
	}
	e.waitQueuesEmpty(qa, 5*time.Second)
	if n := recB.count(msg.UUID); n != 1 {
		t.Fatalf("B saw the message %d times, want 1", n)
	}
	if _, err := amqpretry.New(amqpretry.Config{URI: e.uri, Subscriber: e.retry.SubscriberConfig(),
		QueueType: amqpretry.QueueTypeClassic, Mode: amqpretry.DeadLetterFirst()}); err == nil || !strings.Contains(err.Error(), "DeadLetterFirst") {
		t.Errorf("DeadLetterFirst with classic queues: err = %v, want a Validate error naming the field", err)
	}
}

// DeadLetterFirstRetry of a copy: a retry copy (attempt 3, published to the
// second wait queue) whose next retry is again first-tier goes through Q's
// dead-letter path; back from the first wait queue it is still the
// library's copy (x-first-death-queue: its wait queue), so its attempt
// header and the new rejection both count: attempts [1 2 3 4 5], never a
// count that goes back.
func TestE2E_DeadLetterFirstRetryOfACopy(t *testing.T) {
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) {
		c.Mode = amqpretry.DeadLetterFirst(200*time.Millisecond, 500*time.Millisecond)
		c.MaxAttempts = 5
		c.Backoff = func() backoff.BackOff {
			// 1 -> 2: dead-letter path; 2 -> 3: a copy in the 500 ms wait
			// queue; 3 -> 4 and 4 -> 5: dead-letter path again.
			return &seqBackoff{ds: []time.Duration{200 * time.Millisecond, 500 * time.Millisecond, 200 * time.Millisecond}}
		}
	})
	rec := newRecorder()
	q := e.handle("a", func(msg *message.Message) error {
		rec.record(msg, middleware.Attempt(msg))
		return errTransient
	})
	e.start()
	msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
	e.publish(msg)
	pq := e.retry.Topology().Naming().PoisonQueue(q)
	waitFor(t, 15*time.Second, "poisoned", func() bool { return e.depth(pq) == 1 })
	attempts, _ := rec.get(msg.UUID)
	if fmt.Sprint(attempts) != "[1 2 3 4 5]" {
		t.Errorf("attempts %v, want [1 2 3 4 5]", attempts)
	}
	t.Logf("ACCOUNT TestE2E_DeadLetterFirstRetryOfACopy: published=1 handled=0 poisoned=%d duplicates=0 lost=%d (handler runs %d)",
		e.depth(pq), 1-e.depth(pq), len(attempts))
}

// AMQP properties survive the retry path: the handler sees them on every
// attempt, and the poison copy carries them as properties again.
func TestE2E_PropertiesKeptAcrossRetries(t *testing.T) {
	e := newEnv(t, amqpretry.QueueTypeClassic, func(c *amqpretry.Config) { c.MaxAttempts = 2 })
	rec := newRecorder()
	q := e.handle("svc", func(msg *message.Message) error {
		rec.record(msg, middleware.Attempt(msg))
		return errTransient
	})
	e.start()
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"id":1}`))
	p, err := amqpretry.Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	ts := time.Now().UTC().Truncate(time.Second)
	p.ContentType, p.CorrelationId, p.MessageId, p.Priority, p.Timestamp, p.AppId = "application/json", "corr-1", "mid-1", 3, ts, "shop"
	if err := e.ch.PublishWithContext(context.Background(), e.exchange, "order.created", false, false, p); err != nil {
		t.Fatal(err)
	}
	pq := e.retry.Topology().Naming().PoisonQueue(q)
	waitFor(t, 10*time.Second, "poisoned after 2 attempts", func() bool { return e.depth(pq) == 1 })
	rec.mu.Lock()
	second := rec.meta[msg.UUID][1]
	rec.mu.Unlock()
	if second.Get(retrymeta.PropContentTypeKey) != "application/json" || second.Get(retrymeta.PropCorrelationIDKey) != "corr-1" {
		t.Errorf("second attempt lost properties: %v", second)
	}
	d := e.poisoned(q)[0]
	if d.ContentType != "application/json" || d.CorrelationId != "corr-1" || d.MessageId != "mid-1" ||
		d.Priority != 3 || !d.Timestamp.Equal(ts) || d.AppId != "shop" {
		t.Errorf("poison copy properties: type %q corr %q id %q prio %d ts %v app %q",
			d.ContentType, d.CorrelationId, d.MessageId, d.Priority, d.Timestamp, d.AppId)
	}
	if _, ok := d.Headers[retrymeta.PropContentTypeKey]; ok {
		t.Error("a property was also sent as a header")
	}
}
