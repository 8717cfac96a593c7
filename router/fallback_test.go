package router_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// tierDelayer refuses delayed copies (a wait queue refusing) and takes
// zero-delay ones (the origin queue) unless zeroErr is set.
type tierDelayer struct {
	mu      sync.Mutex
	zero    []*message.Message
	zeroErr error
}

func (d *tierDelayer) Schedule(_ context.Context, msg *message.Message, delay time.Duration) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if delay > 0 {
		return errors.New("wait queue refused the copy")
	}
	if d.zeroErr != nil {
		return d.zeroErr
	}
	d.zero = append(d.zero, msg)
	return nil
}

func newFallbackChain(t *testing.T, d middleware.Delayer, pub message.Publisher) *router.Chain {
	t.Helper()
	c, err := router.New(router.Config{
		Delayer: d, PoisonPublisher: pub, Policy: router.Policy{MaxAttempts: 3, FallbackPause: 30 * time.Millisecond, Backoff: exactBackoff(time.Second), QueueName: func(context.Context) string { return "q" }},
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func msgAt(attempt int) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte("x"))
	m.Metadata.Set(middleware.AttemptKey, strconv.Itoa(attempt))
	return m
}

// A retry the Delayer does not hold: after the pause, a copy goes straight
// back to the queue as the next attempt, and the original is acked.
func TestFallbackRetryNotHeld(t *testing.T) {
	d := &tierDelayer{}
	c := newFallbackChain(t, d, nopPublisher{})
	start := time.Now()
	_, err := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errTransient })(msgAt(1))
	if err != nil {
		t.Fatalf("want ack after the fallback copy, got %v", err)
	}
	if took := time.Since(start); took < 30*time.Millisecond {
		t.Errorf("no pause before the fallback copy (%v)", took)
	}
	if len(d.zero) != 1 || d.zero[0].Metadata.Get(middleware.AttemptKey) != "2" ||
		d.zero[0].Metadata.Get(middleware.ErrorClassKey) != middleware.ClassTransient {
		t.Fatalf("fallback copies %d, metadata %v", len(d.zero), d.zero[0].Metadata)
	}
	// The copy is refused too: the error comes back (nack with requeue).
	d.zeroErr = errors.New("origin queue refused too")
	if _, err := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errTransient })(msgAt(1)); err == nil {
		t.Fatal("both copies refused, yet acked")
	}
}

// A poison copy the broker refuses: the message is parked past its last
// attempt, keeping its class, and is never run again.
func TestFallbackPoisonRefused(t *testing.T) {
	d := &tierDelayer{}
	c := newFallbackChain(t, d, failingPublisher{})
	_, err := c.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.Permanent(errors.New("unknown customer"))
	})(msgAt(1))
	if err != nil || len(d.zero) != 1 {
		t.Fatalf("err %v, parked copies %d", err, len(d.zero))
	}
	parked := d.zero[0]
	if parked.Metadata.Get(middleware.AttemptKey) != "4" || parked.Metadata.Get(middleware.ErrorClassKey) != middleware.ClassPermanent {
		t.Fatalf("parked copy metadata %v", parked.Metadata)
	}
	// Delivered again (to a chain whose poison publisher works): poisoned,
	// handler not run, class kept.
	rec := &poisonRecorder{Publisher: nopPublisher{}}
	c2 := newFallbackChain(t, d, rec)
	ran := false
	if _, err := c2.Middleware(func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil })(parked); err != nil {
		t.Fatal(err)
	}
	if ran || len(rec.all()) != 1 || rec.all()[0].Metadata.Get(middleware.ErrorClassKey) != middleware.ClassPermanent {
		t.Fatalf("ran %v, poisoned %d", ran, len(rec.all()))
	}
	if got := rec.all()[0].Metadata.Get(middleware.PoisonAttemptsKey); got != "4" {
		t.Errorf("attempts %q", got)
	}
}

// A failure after the subscriber gave the delivery back (its context done)
// is neither retried, nor poisoned, nor paused on.
func TestFallbackInterruptedPassesThrough(t *testing.T) {
	d := &tierDelayer{}
	rec := &poisonRecorder{Publisher: nopPublisher{}}
	c := newFallbackChain(t, d, rec)
	ctx, cancel := context.WithCancel(context.Background())
	m := msgAt(3)
	m.SetContext(ctx)
	_, err := c.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		cancel()
		return nil, middleware.Permanent(errors.New("would be poisoned"))
	})(m)
	// The error carries the Classifier's ActionNack (Classify reads a
	// carried classification back; on its own it never answers Nack).
	if err == nil || middleware.DefaultClassifier.Classify(err).Action != middleware.ActionNack || len(d.zero) != 0 || len(rec.all()) != 0 {
		t.Fatalf("err %v, copies %d, poisoned %d", err, len(d.zero), len(rec.all()))
	}
}

// DrainingSubscriber: closing the router lets the in-flight handler finish
// with a live context, and its message is acked, not handed back.
func TestDrainingSubscriberLetsHandlersFinish(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	sub := router.NewDrainingSubscriber(pubsub, 5*time.Second)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	var ctxErr error
	var runs int
	r.AddConsumerHandler("h", "t", sub, func(msg *message.Message) error {
		runs++
		close(entered)
		<-release
		ctxErr = msg.Context().Err()
		return nil
	})
	go func() { _ = r.Run(context.Background()) }()
	recv(t, r.Running(), 5*time.Second)
	if err := pubsub.Publish("t", message.NewMessage("m1", nil)); err != nil {
		t.Fatal(err)
	}
	recv(t, entered, 5*time.Second)
	closed := make(chan error, 1)
	go func() { closed <- r.Close() }()
	recv(t, sub.Draining(), 5*time.Second)
	select {
	case err := <-closed:
		t.Fatalf("router closed (%v) while a handler was still running", err)
	default:
	}
	close(release)
	if err := recv(t, closed, 10*time.Second); err != nil {
		t.Fatalf("router Close: %v", err)
	}
	if ctxErr != nil || runs != 1 {
		t.Fatalf("handler saw context error %v, ran %d times", ctxErr, runs)
	}
	if err := sub.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// A handler that asked for RetryAfter longer than the fallback pause: the
// fallback copy (straight back to the queue, no broker-side delay) is not
// handed over before the requested delay has passed since the failure, so
// the next attempt never runs earlier than the handler asked (issue 18
// item 8: with a 1 s pause a RetryAfter of 1.5 s came back up to 0.5 s
// early).
func TestFallbackHonoursRetryAfter(t *testing.T) {
	d := &tierDelayer{}
	c := newFallbackChain(t, d, nopPublisher{}) // FallbackPause 30 ms
	const asked = 300 * time.Millisecond
	var failedAt time.Time
	_, err := c.Middleware(func(*message.Message) ([]*message.Message, error) {
		failedAt = time.Now()
		return nil, middleware.RetryAfter(errTransient, asked)
	})(msgAt(1))
	if err != nil {
		t.Fatalf("want ack after the fallback copy, got %v", err)
	}
	if len(d.zero) != 1 {
		t.Fatalf("fallback copies %d, want 1", len(d.zero))
	}
	if early := asked - time.Since(failedAt); early > 0 {
		t.Errorf("fallback copy handed over %v after the failure, %v earlier than the RetryAfter of %v", asked-early, early, asked)
	}
}

// secondTryDelayer refuses the first delayed copy and holds the next.
type secondTryDelayer struct {
	mu     sync.Mutex
	calls  int
	held   []time.Duration
	minima []time.Duration
}

func (d *secondTryDelayer) Schedule(ctx context.Context, _ *message.Message, delay time.Duration) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls++
	if d.calls == 1 {
		return errors.New("wait queue refused the copy")
	}
	minimum, _ := middleware.MinimumDelay(ctx)
	d.held, d.minima = append(d.held, delay), append(d.minima, minimum)
	return nil
}

// A RetryAfter too long to hold the delivery for (above a minute): after the
// pause the fallback hands the copy to the Delayer again with the remaining
// delay as delay and floor, instead of sending it straight back early.
func TestFallbackLongRetryAfterTriesDelayerAgain(t *testing.T) {
	d := &secondTryDelayer{}
	c := newFallbackChain(t, d, nopPublisher{})
	const asked = 10 * time.Minute
	_, err := c.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.RetryAfter(errTransient, asked)
	})(msgAt(1))
	if err != nil {
		t.Fatalf("want ack after the second try, got %v", err)
	}
	if len(d.held) != 1 || d.held[0] < asked-time.Second || d.held[0] > asked || d.minima[0] != d.held[0] {
		t.Fatalf("second try: delays %v, floors %v; want one of about %v with the same floor", d.held, d.minima, asked)
	}
}

// refuseDelayedDelayer refuses every copy with a delay and holds the
// zero-delay ones.
type refuseDelayedDelayer struct {
	mu   sync.Mutex
	zero []*message.Message
}

func (d *refuseDelayedDelayer) Schedule(_ context.Context, msg *message.Message, delay time.Duration) error {
	if delay > 0 {
		return errors.New("wait queue refused the copy")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.zero = append(d.zero, msg)
	return nil
}

// A RetryAfter above a minute that the Delayer refuses twice (issue 18 item
// 8): the copy goes straight back, without holding the delivery, carrying
// the remaining delay (retrymeta.RemainingDelayKey), so the
// RedeliveryGuard holds it again before it runs. Before, it came back after
// a minute, earlier than asked.
func TestFallbackLongRetryAfterRefusedCarriesRemainingDelay(t *testing.T) {
	d := &refuseDelayedDelayer{}
	c := newFallbackChain(t, d, nopPublisher{})
	const asked = 10 * time.Minute
	start := time.Now()
	_, err := c.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.RetryAfter(errTransient, asked)
	})(msgAt(1))
	if err != nil {
		t.Fatalf("want ack after the zero-delay copy, got %v", err)
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Errorf("fallback held the delivery %v", took)
	}
	if len(d.zero) != 1 {
		t.Fatalf("zero-delay copies %d, want 1", len(d.zero))
	}
	cp := d.zero[0]
	cp.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true") // as the loop-back delivery would carry
	if r := retrymeta.RemainingDelay(cp); r < asked-time.Minute || r > asked {
		t.Errorf("copy's remaining delay %v, want about %v", r, asked)
	}
	if cp.Metadata.Get(middleware.AttemptKey) != "2" {
		t.Errorf("copy's attempt %q, want 2", cp.Metadata.Get(middleware.AttemptKey))
	}
}
