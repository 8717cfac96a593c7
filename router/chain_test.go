package router_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

func TestFailsTwiceThenSucceeds(t *testing.T) {
	const initial = 50 * time.Millisecond
	var seen calls
	succeeded := make(chan string, 10)
	e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: 5, Backoff: exactBackoff(initial)}}, func(msg *message.Message) ([]*message.Message, error) {
		c := seen.record(msg)
		if c.attempt < 3 {
			return nil, fmt.Errorf("attempt %d: %w", c.attempt, errTransient)
		}
		succeeded <- msg.UUID
		return nil, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":7}`))
	msg.Metadata.Set("trace-id", "abc")
	e.publish(t, msg)

	if got := recv(t, succeeded, 5*time.Second); got != msg.UUID {
		t.Fatalf("succeeded %s", got)
	}
	waitFor(t, 2*time.Second, func() bool { return e.delayer.Pending() == 0 })
	e.closeRouter(t)

	got := seen.get()
	if len(got) != 3 {
		t.Fatalf("handler called %d times, want 3", len(got))
	}
	for i, c := range got {
		if c.uuid != msg.UUID || c.attempt != i+1 || c.md.Get(middleware.AttemptKey) != strconv.Itoa(i+1) {
			t.Errorf("call %d: uuid %s attempt %d (header %q)", i, c.uuid, c.attempt, c.md.Get(middleware.AttemptKey))
		}
		if c.md.Get("trace-id") != "abc" {
			t.Errorf("call %d lost user metadata", i)
		}
	}
	// Gaps are at least the backoff delays: 50 ms after attempt 1, 100 ms after 2.
	for i, want := range []time.Duration{initial, 2 * initial} {
		if gap := got[i+1].at.Sub(got[i].at); gap < want {
			t.Errorf("gap between attempts %d and %d = %v, want >= %v", i+1, i+2, gap, want)
		}
	}
	third := got[2].md
	if third.Get(middleware.DelayKey) != "100" || third.Get(middleware.ErrorClassKey) != middleware.ClassTransient ||
		third.Get(middleware.LastErrorKey) != "attempt 2: service unavailable" || third.Get(middleware.OriginalQueueKey) != topic {
		t.Errorf("failure metadata on attempt 3: %v", third)
	}
	if third.Get(middleware.FirstFailureKey) == "" || third.Get(middleware.FirstFailureKey) == third.Get(middleware.LastFailureKey) {
		t.Errorf("first failure %q should be kept from attempt 1, last %q from attempt 2", third.Get(middleware.FirstFailureKey), third.Get(middleware.LastFailureKey))
	}
	if len(succeeded) != 0 {
		t.Errorf("%d extra successes", len(succeeded))
	}
	if n := len(e.poison.all()); n != 0 {
		t.Errorf("%d poisoned", n)
	}
	retries := e.observer.of("retry")
	if len(retries) != 2 || retries[0].attempt != 1 || retries[0].delay != initial || retries[1].attempt != 2 || retries[1].delay != 2*initial {
		t.Errorf("observed retries %+v", retries)
	}
}

func TestTransientExhaustedIsPoisoned(t *testing.T) {
	var seen calls
	e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: 3}}, func(msg *message.Message) ([]*message.Message, error) {
		seen.record(msg)
		return nil, errTransient
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("p"))
	e.publish(t, msg)

	p := recv(t, e.poisonCh, 5*time.Second)
	p.Ack()
	e.closeRouter(t)

	if p.UUID != msg.UUID || string(p.Payload) != "p" {
		t.Fatalf("poisoned %s %q", p.UUID, p.Payload)
	}
	for k, want := range map[string]string{
		middleware.PoisonAttemptsKey: "3",
		middleware.AttemptKey:        "", // one attempt count on a poison copy: PoisonAttemptsKey
		middleware.ErrorClassKey:     middleware.ClassExhausted,
		retrymeta.PoisonReasonKey:    "gave up after 3 attempts: service unavailable",
		retrymeta.PoisonTopicKey:     topic,
		retrymeta.PoisonHandlerKey:   "worker",
		middleware.OriginalQueueKey:  topic,
	} {
		if got := p.Metadata.Get(k); got != want {
			t.Errorf("poison metadata %s = %q, want %q", k, got, want)
		}
	}
	got := seen.get()
	if len(got) != 3 {
		t.Fatalf("handler called %d times, want 3", len(got))
	}
	for i, c := range got {
		if c.attempt != i+1 {
			t.Errorf("call %d saw attempt %d", i, c.attempt)
		}
	}
	if n := len(e.poison.all()); n != 1 {
		t.Errorf("%d poison messages, want 1", n)
	}
	if e.observer.count("retry") != 2 || e.observer.count("poisoned") != 1 {
		t.Errorf("observer events %+v", e.observer.events)
	}
	if e.delayer.Pending() != 0 {
		t.Errorf("pending %d", e.delayer.Pending())
	}
}

func TestPermanentPoisonedAtOnce(t *testing.T) {
	var seen calls
	e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: 5}}, func(msg *message.Message) ([]*message.Message, error) {
		seen.record(msg)
		return nil, middleware.Permanent(errors.New("customer does not exist"))
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("p"))
	e.publish(t, msg)
	p := recv(t, e.poisonCh, 5*time.Second)
	p.Ack()
	e.closeRouter(t)

	if seen.len() != 1 {
		t.Fatalf("handler called %d times, want 1", seen.len())
	}
	if p.UUID != msg.UUID || p.Metadata.Get(middleware.ErrorClassKey) != middleware.ClassPermanent ||
		p.Metadata.Get(middleware.PoisonAttemptsKey) != "1" || p.Metadata.Get(retrymeta.PoisonReasonKey) != "customer does not exist" {
		t.Fatalf("poison metadata %v", p.Metadata)
	}
	if e.observer.count("retry") != 0 || e.delayer.Pending() != 0 {
		t.Fatalf("a permanent error was retried")
	}
}

func TestMalformedPoisonedAtOnce(t *testing.T) {
	e := newEnv(t, router.Config{}, func(msg *message.Message) ([]*message.Message, error) {
		var v struct{ ID int }
		if err := json.Unmarshal(msg.Payload, &v); err != nil {
			return nil, fmt.Errorf("decoding order: %w", err)
		}
		return nil, nil
	})
	e.publish(t, message.NewMessage(watermill.NewUUID(), []byte(`{"ID": "seven"}`)))
	p := recv(t, e.poisonCh, 5*time.Second)
	p.Ack()
	if p.Metadata.Get(middleware.ErrorClassKey) != middleware.ClassMalformed || p.Metadata.Get(middleware.PoisonAttemptsKey) != "1" {
		t.Fatalf("poison metadata %v", p.Metadata)
	}
}

func TestRetryAfterHonouredEndToEnd(t *testing.T) {
	var seen calls
	done := make(chan struct{})
	e := newEnv(t, router.Config{Policy: router.Policy{Backoff: exactBackoff(20 * time.Millisecond)}}, func(msg *message.Message) ([]*message.Message, error) {
		c := seen.record(msg)
		if c.attempt == 1 {
			return nil, middleware.RetryAfter(errTransient, 150*time.Millisecond)
		}
		close(done)
		return nil, nil
	})
	e.publish(t, message.NewMessage(watermill.NewUUID(), []byte("p")))
	recv(t, done, 5*time.Second)
	got := seen.get()
	if len(got) != 2 {
		t.Fatalf("%d calls", len(got))
	}
	if gap := got[1].at.Sub(got[0].at); gap < 150*time.Millisecond {
		t.Fatalf("gap %v, want >= the requested 150ms", gap)
	}
	if got[1].md.Get(middleware.DelayKey) != "150" || got[1].md.Get(middleware.ErrorClassKey) != middleware.ClassRetryAfter {
		t.Fatalf("metadata %v", got[1].md)
	}
}

func TestDropEndToEnd(t *testing.T) {
	var seen calls
	e := newEnv(t, router.Config{}, func(msg *message.Message) ([]*message.Message, error) {
		seen.record(msg)
		return nil, middleware.Drop(errors.New("order already cancelled"))
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("p"))
	e.publish(t, msg)
	waitFor(t, 5*time.Second, func() bool { return e.observer.count("dropped") == 1 })
	e.closeRouter(t)
	if seen.len() != 1 || len(e.poison.all()) != 0 || e.observer.count("retry") != 0 {
		t.Fatalf("calls %d poisoned %d retries %d", seen.len(), len(e.poison.all()), e.observer.count("retry"))
	}
	if d := e.observer.of("dropped")[0]; d.uuid != msg.UUID || d.attempt != 1 {
		t.Fatalf("dropped event %+v", d)
	}
}

func TestRecovererPanicIsRetriedThenPoisoned(t *testing.T) {
	var seen calls
	e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: 3}}, func(msg *message.Message) ([]*message.Message, error) {
		c := seen.record(msg)
		panic(fmt.Sprintf("nil map write on attempt %d", c.attempt))
	}, wmw.Recoverer)
	msg := message.NewMessage(watermill.NewUUID(), []byte("p"))
	e.publish(t, msg)
	p := recv(t, e.poisonCh, 5*time.Second)
	p.Ack()
	e.closeRouter(t)

	got := seen.get()
	if len(got) != 3 {
		t.Fatalf("handler called %d times, want 3", len(got))
	}
	for i, c := range got {
		if c.attempt != i+1 {
			t.Errorf("call %d saw attempt %d", i, c.attempt)
		}
	}
	if p.UUID != msg.UUID || p.Metadata.Get(middleware.ErrorClassKey) != middleware.ClassExhausted || p.Metadata.Get(middleware.PoisonAttemptsKey) != "3" {
		t.Fatalf("poison metadata %v", p.Metadata)
	}
	reason := p.Metadata.Get(retrymeta.PoisonReasonKey)
	if !strings.Contains(reason, "panic occurred") || !strings.Contains(reason, "nil map write on attempt 3") {
		t.Errorf("reason %q", reason)
	}
	if len(reason) > retrymeta.DefaultMaxErrorBytes {
		t.Errorf("reason (with stack trace) is %d bytes, over the %d cap", len(reason), retrymeta.DefaultMaxErrorBytes)
	}
	if e.observer.count("retry") != 2 || len(e.poison.all()) != 1 {
		t.Errorf("retries %d poisoned %d", e.observer.count("retry"), len(e.poison.all()))
	}
}

func TestRecovererPanicOnceThenSuccess(t *testing.T) {
	var seen calls
	done := make(chan struct{})
	e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: 3}}, func(msg *message.Message) ([]*message.Message, error) {
		if seen.record(msg).attempt == 1 {
			panic("boom")
		}
		close(done)
		return nil, nil
	}, wmw.Recoverer)
	e.publish(t, message.NewMessage(watermill.NewUUID(), []byte("p")))
	recv(t, done, 5*time.Second)
	e.closeRouter(t)
	if seen.len() != 2 || len(e.poison.all()) != 0 {
		t.Fatalf("calls %d poisoned %d", seen.len(), len(e.poison.all()))
	}
	if c := seen.get()[1]; c.md.Get(middleware.ErrorClassKey) != middleware.ClassTransient || !strings.Contains(c.md.Get(middleware.LastErrorKey), "boom") {
		t.Fatalf("retry metadata %v", c.md)
	}
}

// outcome of one attempt in the random plan.
type outcome int

const (
	ok outcome = iota
	transient
	permanent
)

func TestManyMessagesRandomFailures(t *testing.T) {
	const (
		n           = 200
		maxAttempts = 4
	)
	rng := rand.New(rand.NewPCG(42, 7))
	plans := make([][]outcome, n)
	type expectation struct {
		success  bool
		attempts int
		class    string
	}
	want := make([]expectation, n)
	for i := range plans {
		plan := make([]outcome, maxAttempts)
		for a := range plan {
			switch r := rng.IntN(10); {
			case r < 5:
				plan[a] = transient
			case r < 6:
				plan[a] = permanent
			default:
				plan[a] = ok
			}
		}
		plans[i] = plan
		for a := 1; a <= maxAttempts; a++ {
			switch plan[a-1] {
			case ok:
				want[i] = expectation{success: true, attempts: a}
			case permanent:
				want[i] = expectation{attempts: a, class: middleware.ClassPermanent}
			case transient:
				if a == maxAttempts {
					want[i] = expectation{attempts: a, class: middleware.ClassExhausted}
				}
				continue
			}
			break
		}
	}

	var mu sync.Mutex
	attemptsSeen := map[string][]int{}
	successes := map[string]int{}
	var badAttempt atomic.Value
	var successCount atomic.Int64
	e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: maxAttempts, Backoff: func() backoff.BackOff {
		b := exactBackoff(10 * time.Millisecond)().(*backoff.ExponentialBackOff)
		b.RandomizationFactor = 0.5
		b.MaxInterval = 40 * time.Millisecond
		return b
	}}}, func(msg *message.Message) ([]*message.Message, error) {
		i, err := strconv.Atoi(string(msg.Payload))
		if err != nil {
			return nil, middleware.Permanent(err)
		}
		a := middleware.Attempt(msg)
		mu.Lock()
		prev := attemptsSeen[msg.UUID]
		if len(prev) != a-1 {
			badAttempt.Store(fmt.Sprintf("message %d: attempt %d after %v", i, a, prev))
		}
		attemptsSeen[msg.UUID] = append(prev, a)
		mu.Unlock()
		if a > maxAttempts {
			return nil, middleware.Permanent(errors.New("beyond max attempts"))
		}
		switch plans[i][a-1] {
		case transient:
			return nil, fmt.Errorf("message %d attempt %d: %w", i, a, errTransient)
		case permanent:
			return nil, middleware.Permanent(fmt.Errorf("message %d attempt %d refused", i, a))
		}
		mu.Lock()
		successes[msg.UUID]++
		mu.Unlock()
		successCount.Add(1)
		return nil, nil
	})

	uuids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		uuids[i] = fmt.Sprintf("msg-%03d", i)
		msgs[i] = message.NewMessage(uuids[i], []byte(strconv.Itoa(i)))
	}
	e.publish(t, msgs...)

	waitFor(t, 10*time.Second, func() bool {
		return int(successCount.Load())+len(e.poison.all()) >= n && e.delayer.Pending() == 0
	})
	e.closeRouter(t)

	if v := badAttempt.Load(); v != nil {
		t.Fatal(v)
	}
	poisoned := map[string]*message.Message{}
	for _, p := range e.poison.all() {
		if _, dup := poisoned[p.UUID]; dup {
			t.Errorf("%s poisoned twice", p.UUID)
		}
		poisoned[p.UUID] = p
	}
	var wantSuccess, wantPoison int
	for i, w := range want {
		u := uuids[i]
		mu.Lock()
		seen, succ := attemptsSeen[u], successes[u]
		mu.Unlock()
		p, isPoisoned := poisoned[u]
		if len(seen) != w.attempts {
			t.Errorf("message %d (plan %v): %d attempts, want %d", i, plans[i], len(seen), w.attempts)
		}
		if w.success {
			wantSuccess++
			if succ != 1 || isPoisoned {
				t.Errorf("message %d (plan %v): successes %d, poisoned %v; want one success", i, plans[i], succ, isPoisoned)
			}
			continue
		}
		wantPoison++
		if succ != 0 || !isPoisoned {
			t.Errorf("message %d (plan %v): successes %d, poisoned %v; want poisoned", i, plans[i], succ, isPoisoned)
			continue
		}
		if p.Metadata.Get(middleware.ErrorClassKey) != w.class || p.Metadata.Get(middleware.PoisonAttemptsKey) != strconv.Itoa(w.attempts) {
			t.Errorf("message %d (plan %v): poisoned with class %q after %q attempts; want %q after %d", i, plans[i],
				p.Metadata.Get(middleware.ErrorClassKey), p.Metadata.Get(middleware.PoisonAttemptsKey), w.class, w.attempts)
		}
	}
	if int(successCount.Load()) != wantSuccess || len(poisoned) != wantPoison || wantSuccess+wantPoison != n {
		t.Errorf("successes %d (want %d), poisoned %d (want %d)", successCount.Load(), wantSuccess, len(poisoned), wantPoison)
	}
	if wantSuccess == 0 || wantPoison == 0 {
		t.Errorf("the seed should produce both outcomes: %d successes, %d poisoned", wantSuccess, wantPoison)
	}
	if e.delayer.Pending() != 0 {
		t.Errorf("pending %d", e.delayer.Pending())
	}
	if got := e.observer.count("poisoned"); got != wantPoison {
		t.Errorf("observer saw %d poisonings, want %d", got, wantPoison)
	}
	t.Logf("%d succeeded, %d poisoned, %d retries", wantSuccess, wantPoison, e.observer.count("retry"))
}

func TestShutdownNeverPoisonsTransient(t *testing.T) {
	for _, closeDelayerFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("closeDelayerFirst=%v", closeDelayerFirst), func(t *testing.T) {
			const n = 10
			entered := make(chan string, 1)
			var blockerErr atomic.Value
			e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: 2, Backoff: exactBackoff(10 * time.Second)}}, func(msg *message.Message) ([]*message.Message, error) {
				if string(msg.Payload) == "blocker" {
					select { // gochannel redelivers a nacked message, even while closing
					case entered <- msg.UUID:
					default:
					}
					<-msg.Context().Done()
					blockerErr.Store(msg.Context().Err())
					return nil, msg.Context().Err()
				}
				return nil, errTransient
			})
			for i := range n - 1 {
				e.publish(t, message.NewMessage(fmt.Sprintf("m%d", i), []byte("normal")))
			}
			waitFor(t, 5*time.Second, func() bool { return e.delayer.Pending() == n-1 })
			blocker := message.NewMessage("blocker", []byte("blocker"))
			e.publish(t, blocker)
			recv(t, entered, 5*time.Second)

			if closeDelayerFirst {
				err := e.delayer.Close()
				if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d waiting", n-1)) {
					t.Fatalf("delayer Close = %v, want %d dropped", err, n-1)
				}
			}
			e.closeRouter(t)

			if v := blockerErr.Load(); v == nil || !errors.Is(v.(error), context.Canceled) {
				t.Fatalf("the blocked handler saw %v, want context.Canceled", v)
			}
			if p := e.poison.all(); len(p) != 0 {
				t.Fatalf("%d messages poisoned on shutdown (first: %s, %v)", len(p), p[0].UUID, p[0].Metadata)
			}
			if e.observer.count("poisoned") != 0 {
				t.Fatal("observer saw a poisoning")
			}
			// The interrupted message's delivery was already given back by the
			// subscriber (its context was done): the chain neither scheduled a
			// retry nor tried to, and never poisoned it.
			for _, kind := range []string{"retry", "retry-failed"} {
				for _, ev := range e.observer.of(kind) {
					if ev.uuid == blocker.UUID {
						t.Fatalf("%s event for the interrupted message: %+v", kind, ev)
					}
				}
			}
			if closeDelayerFirst {
				return
			}
			if got := e.delayer.Pending(); got != n-1 {
				t.Fatalf("pending %d, want %d", got, n-1)
			}
			err := e.delayer.Close()
			if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d waiting", n-1)) {
				t.Fatalf("delayer Close = %v, want %d dropped", err, n-1)
			}
		})
	}
}

func TestChainDirect(t *testing.T) {
	d := &fakeDelayer{}
	pub := &poisonRecorder{Publisher: nopPublisher{}}
	chain, err := router.New(router.Config{
		Delayer: d, PoisonPublisher: pub, Policy: router.Policy{MaxAttempts: 3, Backoff: exactBackoff(100 * time.Millisecond), QueueName: func(context.Context) string { return "q" }},
		// The sources amqpretry.New gives the chain (the router's default is
		// the attempt header only).
		AttemptSources: amqpwire.Sources(func(*message.Message) string { return "q" }, false),
	})
	if err != nil {
		t.Fatal(err)
	}
	fail := func(*message.Message) ([]*message.Message, error) { return nil, errTransient }

	// Attempt 1 is retried.
	msg := message.NewMessage("a", nil)
	if _, err := chain.Middleware(fail)(msg); err != nil {
		t.Fatal(err)
	}
	if d.n.Load() != 1 || d.last.Metadata.Get(middleware.AttemptKey) != "2" || d.lastDelay != 100*time.Millisecond {
		t.Fatalf("scheduled %d, attempt %q, delay %v", d.n.Load(), d.last.Metadata.Get(middleware.AttemptKey), d.lastDelay)
	}
	// x-death rejections from the queue count: header 1 + 1 rejection = attempt 2; + 1 more = 3 = exhausted.
	msg = message.NewMessage("b", nil)
	msg.Metadata.Set(retrymeta.DeliveryExchangeKey, "") // back through a retry route, as the Marshaler tells
	msg.Metadata.Set(retrymeta.DeliveryRetryRouteKey, "true")
	msg.Metadata.Set(middleware.XDeathKey, wire.EncodeXDeath([]amqpwire.DeathRecord{{Queue: "q", Reason: "rejected", Count: 2}}))
	if _, err := chain.Middleware(fail)(msg); err != nil {
		t.Fatal(err)
	}
	if d.n.Load() != 1 {
		t.Fatalf("an exhausted message was scheduled")
	}
	ps := pub.all()
	if len(ps) != 1 || ps[0].UUID != "b" || ps[0].Metadata.Get(middleware.PoisonAttemptsKey) != "3" || ps[0].Metadata.Get(middleware.ErrorClassKey) != middleware.ClassExhausted {
		t.Fatalf("poisoned %v", ps)
	}
	if _, ok := ps[0].Metadata[middleware.XDeathKey]; ok {
		t.Fatal("poison copy carries x-death")
	}

	// A Delayer failure nacks and never poisons.
	d.err = errors.New("no confirm")
	_, err = chain.Middleware(fail)(message.NewMessage("c", nil))
	var se *chainerr.ScheduleError
	if !errors.As(err, &se) || se.Attempt != 1 {
		t.Fatalf("got %v, want *ScheduleError", err)
	}
	if len(pub.all()) != 1 {
		t.Fatal("a failed schedule was poisoned")
	}

	// A failed poison publish nacks.
	failing := &poisonRecorder{Publisher: failingPublisher{}}
	chain2, err := router.New(router.Config{Delayer: d, PoisonPublisher: failing})
	if err != nil {
		t.Fatal(err)
	}
	_, err = chain2.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.Permanent(errors.New("x"))
	})(message.NewMessage("d", nil))
	var pe *chainerr.PoisonError
	if !errors.As(err, &pe) {
		t.Fatalf("got %v, want *PoisonError", err)
	}
}

func TestChainClassifierConfigUsed(t *testing.T) {
	errNotFound := errors.New("not found")
	d := &fakeDelayer{}
	pub := &poisonRecorder{Publisher: nopPublisher{}}
	chain, err := router.New(router.Config{Delayer: d, PoisonPublisher: pub, Policy: router.Policy{Classifier: middleware.ClassifierConfig{
		Rules: []middleware.Rule{{Class: "not-found", Match: middleware.MatchIs(errNotFound), Action: middleware.ActionPoison}},
	}, ErrorText: func(err error) string { return "redacted" }}, PoisonTopic: func(context.Context) string { return "dlq" }})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := chain.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, fmt.Errorf("lookup: %w", errNotFound)
	})(message.NewMessage("a", nil)); err != nil {
		t.Fatal(err)
	}
	ps := pub.all()
	if len(ps) != 1 || ps[0].Metadata.Get(middleware.ErrorClassKey) != "not-found" || ps[0].Metadata.Get(retrymeta.PoisonReasonKey) != "redacted" || d.n.Load() != 0 {
		t.Fatalf("poisoned %v", ps)
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if len(pub.topics) != 1 || pub.topics[0] != "dlq" {
		t.Fatalf("topics %v", pub.topics)
	}
}

func TestConfigValidate(t *testing.T) {
	d := &fakeDelayer{}
	pub := nopPublisher{}
	tests := []struct {
		name string
		cfg  router.Config
		want string
	}{
		{"no delayer", router.Config{PoisonPublisher: pub}, "Delayer"},
		{"no poison publisher", router.Config{Delayer: d}, "PoisonPublisher"},
		{"negative max attempts", router.Config{Delayer: d, PoisonPublisher: pub, Policy: router.Policy{MaxAttempts: -1}}, "MaxAttempts"},
		{"max attempts above cap", router.Config{Delayer: d, PoisonPublisher: pub, Policy: router.Policy{MaxAttempts: 1001}}, "MaxAttempts"},
		{"bad classifier rule", router.Config{Delayer: d, PoisonPublisher: pub, Policy: router.Policy{Classifier: middleware.ClassifierConfig{Rules: []middleware.Rule{{Class: "x"}}}}}, "Rules[0].Match"},
		{"bad attempt source", router.Config{Delayer: d, PoisonPublisher: pub, AttemptSources: []middleware.AttemptSource{{Name: "x"}}}, "Sources[0].Previous"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := router.New(tc.cfg)
			if err == nil || c != nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New = %v, %v; want an error naming %q", c, err, tc.want)
			}
		})
	}
	c, err := router.New(router.Config{Delayer: d, PoisonPublisher: pub})
	if err != nil || c.Republisher.MaxAttempts() != 5 {
		t.Fatalf("defaults: %v %v", c, err)
	}
}

// Issue #18 item 1 on gochannel: whatever attempt headers a message arrives
// with (a producer's, another queue's chain's, a forged x-death), its first
// run here happens, and it runs exactly MaxAttempts times before the poison
// queue; the copies carry this queue's own count.
func TestForeignCountsNeverDecideFirstRun(t *testing.T) {
	const maxAttempts = 3
	var seen calls
	e := newEnv(t, router.Config{Policy: router.Policy{MaxAttempts: maxAttempts}}, func(msg *message.Message) ([]*message.Message, error) {
		seen.record(msg)
		return nil, errTransient
	})
	forged := map[string]map[string]string{
		"attempt 99":            {middleware.AttemptKey: "99"},
		"attempt = MaxAttempts": {middleware.AttemptKey: strconv.Itoa(maxAttempts)},
		"x-death 50 for Q": {middleware.XDeathKey: wire.EncodeXDeath([]amqpwire.DeathRecord{
			{Queue: topic, Reason: "rejected", Count: 50}})},
		"another queue's chain": {middleware.AttemptKey: "4", middleware.OriginalQueueKey: "payments",
			retrymeta.RedeliveriesKey: "2", middleware.FirstFailureKey: "2026-01-01T00:00:00Z"},
	}
	names := map[string]string{}
	for name, md := range forged {
		msg := message.NewMessage(watermill.NewUUID(), []byte(name))
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		names[msg.UUID] = name
		e.publish(t, msg)
	}
	poisoned := map[string]*message.Message{}
	for len(poisoned) < len(forged) {
		p := recv(t, e.poisonCh, 10*time.Second)
		p.Ack()
		poisoned[p.UUID] = p
	}
	e.closeRouter(t)
	runs := map[string][]int{}
	for _, c := range seen.get() {
		runs[c.uuid] = append(runs[c.uuid], c.attempt)
	}
	handlerRuns := 0
	for uuid, name := range names {
		handlerRuns += len(runs[uuid])
		if !slices.Equal(runs[uuid], []int{1, 2, 3}) {
			t.Errorf("%s: runs at attempts %v, want [1 2 3]", name, runs[uuid])
		}
		if p := poisoned[uuid]; p == nil || p.Metadata.Get(middleware.PoisonAttemptsKey) != strconv.Itoa(maxAttempts) {
			t.Errorf("%s: poison copy %v", name, p)
		}
	}
	t.Logf("ACCOUNT TestForeignCountsNeverDecideFirstRun: published=%d handled=0 poisoned=%d duplicates=0 lost=%d (handler runs %d)",
		len(forged), len(poisoned), len(forged)-len(poisoned), handlerRuns)
}

// A Delayer that holds at most 60 ms per hop (as amqpretry's longest tier
// does) and a RetryAfter of 250 ms (issue 18 item 8): the copy carries the
// remaining delay, the chain holds it again without running it, and the
// second attempt runs no earlier than asked, as attempt 2, with no
// redelivery counted and no poisoning.
func TestRetryAfterLongerThanDelayerHoldsEndToEnd(t *testing.T) {
	const hold, asked = 60 * time.Millisecond, 250 * time.Millisecond
	var hops atomic.Int64
	wrap := func(inner middleware.Delayer) middleware.Delayer {
		return testkit.DelayerFunc(func(ctx context.Context, msg *message.Message, delay time.Duration) error {
			if m, ok := middleware.MinimumDelay(ctx); ok {
				delay = max(delay, m)
			}
			held := min(delay, hold)
			retrymeta.SetRemainingDelay(msg.Metadata, delay-held)
			msg.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true") // amqpretry's Marshaler sets it from the delivery
			hops.Add(1)
			return inner.Schedule(ctx, msg, held)
		})
	}
	var seen calls
	done := make(chan struct{})
	e := newEnvWrapped(t, router.Config{Policy: router.Policy{MaxRedeliveries: 1}}, wrap, func(msg *message.Message) ([]*message.Message, error) {
		c := seen.record(msg)
		if c.attempt == 1 {
			return nil, middleware.RetryAfter(errTransient, asked)
		}
		close(done)
		return nil, nil
	})
	e.publish(t, message.NewMessage(watermill.NewUUID(), []byte("p")))
	recv(t, done, 5*time.Second)
	got := seen.get()
	if len(got) != 2 || got[0].attempt != 1 || got[1].attempt != 2 {
		t.Fatalf("calls %+v, want attempts 1 and 2", got)
	}
	if gap := got[1].at.Sub(got[0].at); gap < asked {
		t.Errorf("second attempt %v after the first, earlier than the %v asked", gap, asked)
	}
	if n := hops.Load(); n != 5 { // 60+60+60+60+10 ms
		t.Errorf("%d hops, want 5", n)
	}
	if got[1].md.Get(retrymeta.RedeliveriesKey) != "" || got[1].md.Get(middleware.DelayKey) != "250" {
		t.Errorf("second attempt's metadata %v", got[1].md)
	}
	if e.observer.count("poisoned") != 0 || e.observer.count("retry") != 1 {
		t.Errorf("observer: %d poisoned, %d retries; want 0, 1", e.observer.count("poisoned"), e.observer.count("retry"))
	}
}

// A gochannel poison topic nobody subscribes to yet silently drops the
// message (issue #20 item 8): router.New refuses a non-persistent GoChannel
// as PoisonPublisher, naming the field and the fix, and accepts a persistent
// one, whose poisoned message a late subscriber still receives.
func TestNewRefusesVolatileGoChannelPoison(t *testing.T) {
	d := &fakeDelayer{}
	volatile := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer volatile.Close()
	_, err := router.New(router.Config{Delayer: d, PoisonPublisher: volatile})
	if err == nil || !strings.Contains(err.Error(), "PoisonPublisher") || !strings.Contains(err.Error(), "Persistent: true") {
		t.Fatalf("New with a non-persistent gochannel poison publisher: %v", err)
	}

	persistent := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer persistent.Close()
	chain, err := router.New(router.Config{Delayer: d, PoisonPublisher: persistent})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte("p"))
	refuse := func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.Permanent(errors.New("bad"))
	}
	if _, err := chain.Middleware(refuse)(msg); err != nil {
		t.Fatal(err)
	}
	// Subscribed only after the poisoning: the message is still there.
	ch, err := persistent.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	p := recv(t, ch, 5*time.Second)
	p.Ack()
	if p.UUID != msg.UUID || p.Metadata.Get(middleware.ErrorClassKey) != middleware.ClassPermanent {
		t.Fatalf("poisoned %s class %q", p.UUID, p.Metadata.Get(middleware.ErrorClassKey))
	}
	t.Logf("ACCOUNT published=1 handled=0 poisoned=1 duplicates=0 lost=0")
}
