package cascade_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// retryLateTolerance bounds how late a retry may come back through the
// cascade, on top of the delay rounded up to the grain. What adds up: the
// retry publish and its confirm (a quorum level queue commits through Raft
// with an fsync), one hop per set bit of the grain count (each a quorum
// write plus the at-least-once dead-letter worker's confirmed publish), and
// the delivery to the consumer. The package's broker tests measure 1–25 ms
// in total for 0–6 hops on this busy 2-core machine, and 150–300 ms for the
// worst message of a burst; these tests send one message at a time. 500 ms
// leaves room for a loaded -race run while staying below the 2 s wait-queue
// tier amqpretry's tiered Delayer would have used for RetryAfter(1.3s)
// (default tiers 1 s, 2 s, 4 s, 8 s), so a tier rounding cannot pass.
const retryLateTolerance = 500 * time.Millisecond

// earlyPerHop: the broker keeps enqueue times in whole milliseconds, so a
// level's TTL can end up to 1 ms before TTL × real time (see the package's
// TestArrivalTimes); the handler-start timestamps we compare are taken
// before the publish, so in practice the gap is never short.
const earlyPerHop = time.Millisecond

const routingKey = "order.created"

const watermillUUIDHeader = wamqp.DefaultMessageUUIDHeaderKey

// retryEnv is a business exchange with queues bound by routingKey, an
// amqpretry.Retry on a cascade of its own, and a router.
type retryEnv struct {
	t        *testing.T
	uri      string
	exchange string
	cascade  cascade.Config
	retry    *amqpretry.Retry
	sub      message.Subscriber
	router   *message.Router
	conn     *amqp.Connection
	queues   []string
}

func newRetryEnv(t *testing.T, maxAttempts int, policy func() backoff.BackOff, opts ...func(*cascade.Config)) *retryEnv {
	t.Helper()
	uri := testkit.URI(t)
	name := testkit.UniqueName(t, "cascretry")
	e := &retryEnv{t: t, uri: uri, exchange: name + ".biz", cascade: cascade.Config{Prefix: name + ".delay"}}
	for _, o := range opts {
		o(&e.cascade)
	}
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	e.conn = conn
	t.Cleanup(e.cleanup) // registered first: runs after the router and Retry are closed

	subCfg := wamqp.NewDurableQueueConfig(uri)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return e.exchange }, Type: "direct", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return routingKey }}
	r, err := amqpretry.New(amqpretry.Config{
		URI: uri, Subscriber: subCfg, Policy: router.Policy{MaxAttempts: maxAttempts, Backoff: policy, FallbackPause: -1},
		Mode:           cascade.Mode(e.cascade),
		ConfirmTimeout: 20 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	e.retry = r
	if n := len(r.Topology().Tiers()); n != 0 {
		t.Errorf("Topology has %d tiers with the cascade, want none", n)
	}
	sub, err := r.NewSubscriber(watermill.NopLogger{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	e.sub = sub
	rt, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	rt.AddMiddleware(r.Middleware)
	e.router = rt
	return e
}

func (e *retryEnv) handle(service string, h message.NoPublishHandlerFunc) string {
	q := e.exchange[:len(e.exchange)-len(".biz")] + "." + service
	e.queues = append(e.queues, q)
	e.router.AddConsumerHandler(service, q, e.sub, h)
	return q
}

func (e *retryEnv) start() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := e.router.Run(ctx); err != nil {
			e.t.Errorf("router: %v", err)
		}
	}()
	e.t.Cleanup(func() {
		_ = e.router.Close()
		cancel()
		<-done
		_ = e.sub.Close()
		_ = e.retry.Close()
	})
	select {
	case <-e.router.Running():
	case <-time.After(20 * time.Second):
		e.t.Fatal("router did not start")
	}
}

func (e *retryEnv) cleanup() {
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Errorf("cleanup channel: %v", err)
		_ = e.conn.Close()
		return
	}
	for _, q := range e.queues {
		for _, name := range []string{q, q + ".poison"} {
			if _, err := ch.QueueDelete(name, false, false, false); err != nil {
				e.t.Errorf("deleting %s: %v", name, err)
			}
		}
	}
	_ = ch.ExchangeDelete(e.exchange, false, false)
	if err := cascade.Core(e.cascade).Delete(ch); err != nil {
		e.t.Errorf("deleting the cascade: %v", err)
	}
	_ = ch.Close()
	_ = e.conn.Close()
}

func (e *retryEnv) publish(msg *message.Message) {
	e.t.Helper()
	p, err := amqpretry.Marshaler{}.Marshal(msg)
	if err != nil {
		e.t.Fatal(err)
	}
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		e.t.Fatal(err)
	}
	conf, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), e.exchange, routingKey, true, false, p)
	if err != nil {
		e.t.Fatal(err)
	}
	if ok, err := conf.WaitContext(context.Background()); !ok || err != nil {
		e.t.Fatalf("publish not confirmed: %v %v", ok, err)
	}
}

// seen is what a handler observed of one delivery.
type seen struct {
	uuid    string
	attempt int
	at      time.Time
	md      message.Metadata
}

type obsLog struct {
	mu   sync.Mutex
	msgs []seen
	ch   chan seen
}

func newLog() *obsLog { return &obsLog{ch: make(chan seen, 100)} }

func (l *obsLog) add(msg *message.Message) seen {
	s := seen{uuid: msg.UUID, attempt: middleware.Attempt(msg), at: time.Now(), md: message.Metadata{}}
	for k, v := range msg.Metadata {
		s.md[k] = v
	}
	l.mu.Lock()
	l.msgs = append(l.msgs, s)
	l.mu.Unlock()
	l.ch <- s
	return s
}

func (l *obsLog) all() []seen {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]seen(nil), l.msgs...)
}

// checkGap asserts that attempt 2 came delay (rounded up to the grain)
// after attempt 1, and not later than retryLateTolerance more.
func checkGap(t *testing.T, first, second seen, delay time.Duration) {
	t.Helper()
	grain := 100 * time.Millisecond // the default Grain
	rounded := (delay + grain - 1) / grain * grain
	n := uint64(rounded / grain)
	hops := 0
	for ; n > 0; n &= n - 1 {
		hops++
	}
	gap := second.at.Sub(first.at)
	t.Logf("attempt 2 came %v after attempt 1 (delay %v, %d hops, late by %v)", gap.Round(time.Millisecond), delay, hops, (gap - delay).Round(time.Millisecond))
	if gap < delay-time.Duration(hops)*earlyPerHop {
		t.Errorf("gap %v is shorter than the delay %v", gap, delay)
	}
	if gap >= delay+grain+retryLateTolerance {
		t.Errorf("gap %v is not below %v + grain %v + tolerance %v: rounded to a tier, or late", gap, delay, grain, retryLateTolerance)
	}
}

func checkOrigin(t *testing.T, s seen, q, exchange string) {
	t.Helper()
	want := map[string]string{
		middleware.OriginalQueueKey:      q,
		middleware.OriginalExchangeKey:   exchange,
		middleware.OriginalRoutingKeyKey: routingKey,
		retrymeta.DeliveryRetryPathKey:   "true",
	}
	for k, v := range want {
		if got := s.md.Get(k); got != v {
			t.Errorf("attempt %d: %s = %q, want %q", s.attempt, k, got, v)
		}
	}
}

// TestRetryAfterExact: a handler's RetryAfter(1.3s), between the default
// tiers 1 s and 2 s, is honoured to the grain; the retry keeps its origin,
// has attempt number 2, and reaches Q only: a second queue bound to the
// same exchange with the same routing key never sees it.
func TestRetryAfterExact(t *testing.T) {
	const retryAfter = 1300 * time.Millisecond
	e := newRetryEnv(t, 5, testkit.ExactBackoff(100*time.Millisecond))
	orders, other := newLog(), newLog()
	sentinel := "sentinel-" + watermill.NewShortUUID()
	q := e.handle("orders", func(msg *message.Message) error {
		s := orders.add(msg)
		if msg.UUID != sentinel && s.attempt == 1 {
			return middleware.RetryAfter(errors.New("rate limited"), retryAfter)
		}
		return nil
	})
	otherQ := e.handle("audit", func(msg *message.Message) error {
		other.add(msg)
		return nil
	})
	e.start()

	e.publish(message.NewMessage("order-1", []byte("x")))
	first := testkit.Recv(t, orders.ch, 20*time.Second)
	second := testkit.Recv(t, orders.ch, 20*time.Second)
	if first.uuid != "order-1" || second.uuid != "order-1" {
		t.Fatalf("got %q then %q, want order-1 twice", first.uuid, second.uuid)
	}
	if first.attempt != 1 || second.attempt != 2 {
		t.Fatalf("attempts %d, %d; want 1, 2", first.attempt, second.attempt)
	}
	checkGap(t, first, second, retryAfter)
	checkOrigin(t, second, q, e.exchange)
	if got := second.md.Get(retrymeta.DeliveryExchangeKey); got == e.exchange {
		t.Errorf("attempt 2 was delivered from the business exchange, not the cascade")
	}

	// Only Q: the sentinel, published after the retry was delivered to Q,
	// reaches the audit queue after anything routed there before it.
	e.publish(message.NewMessage(sentinel, []byte("s")))
	for {
		if s := testkit.Recv(t, other.ch, 20*time.Second); s.uuid == sentinel {
			break
		}
	}
	var got []string
	for _, s := range other.all() {
		got = append(got, s.uuid+"#"+strconv.Itoa(s.attempt))
	}
	if len(got) != 2 || got[0] != "order-1#1" || got[1] != sentinel+"#1" {
		t.Errorf("queue %s saw %v, want only the original and the sentinel", otherQ, got)
	}
}

// TestComputedBackoffExact: a computed backoff of 700 ms (no RetryAfter)
// is waited exactly, with no wait queue declared for Q.
func TestComputedBackoffExact(t *testing.T) {
	const delay = 700 * time.Millisecond
	e := newRetryEnv(t, 3, testkit.ExactBackoff(delay))
	orders := newLog()
	q := e.handle("orders", func(msg *message.Message) error {
		if s := orders.add(msg); s.attempt == 1 {
			return errors.New("flaky")
		}
		return nil
	})
	e.start()

	e.publish(message.NewMessage("order-2", []byte("x")))
	first := testkit.Recv(t, orders.ch, 20*time.Second)
	second := testkit.Recv(t, orders.ch, 20*time.Second)
	if first.attempt != 1 || second.attempt != 2 || second.uuid != "order-2" {
		t.Fatalf("got %s#%d then %s#%d, want order-2#1 then order-2#2", first.uuid, first.attempt, second.uuid, second.attempt)
	}
	checkGap(t, first, second, delay)
	checkOrigin(t, second, q, e.exchange)
	if got := second.md.Get(middleware.DelayKey); got != "700" {
		t.Errorf("%s = %q, want 700", middleware.DelayKey, got)
	}

	// No wait queue: the tiered Delayer's would be "<Q>.wait.700ms".
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	_, err = ch.QueueDeclarePassive(q+".wait.700ms", false, false, false, false, nil)
	var aerr *amqp.Error
	if !errors.As(err, &aerr) || aerr.Code != amqp.NotFound {
		t.Errorf("wait queue %s.wait.700ms: %v, want 404 NOT_FOUND", q, err)
	}
}

// TestExhaustedPoisons: with MaxAttempts 2, a message failing twice (the
// second time after a retry through the cascade) is poisoned into
// Q.poison, with attempt 2 and its origin.
func TestExhaustedPoisons(t *testing.T) {
	e := newRetryEnv(t, 2, testkit.ExactBackoff(200*time.Millisecond))
	orders := newLog()
	q := e.handle("orders", func(msg *message.Message) error {
		orders.add(msg)
		return errors.New("always failing")
	})
	e.start()

	e.publish(message.NewMessage("order-3", []byte("x")))
	first := testkit.Recv(t, orders.ch, 20*time.Second)
	second := testkit.Recv(t, orders.ch, 20*time.Second)
	if first.attempt != 1 || second.attempt != 2 {
		t.Fatalf("attempts %d, %d; want 1, 2", first.attempt, second.attempt)
	}
	checkGap(t, first, second, 200*time.Millisecond)

	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	var d amqp.Delivery
	testkit.WaitFor(t, 20*time.Second, "the poison copy in "+q+".poison", func() bool {
		var ok bool
		d, ok, err = ch.Get(q+".poison", true)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	})
	// The headers as published (Unmarshal would replace the origin keys of
	// a delivery from the poison exchange, which is no retry path).
	if got := d.Headers[watermillUUIDHeader]; got != "order-3" {
		t.Errorf("poisoned %v, want order-3", got)
	}
	for k, want := range map[string]string{
		middleware.PoisonAttemptsKey:   "2",
		middleware.OriginalQueueKey:    q,
		middleware.OriginalExchangeKey: e.exchange,
	} {
		if got := d.Headers[k]; got != want {
			t.Errorf("poison copy %s = %v, want %q", k, got, want)
		}
	}
	// One attempt count on a poison copy (PoisonAttemptsKey), not also the
	// delivery's attempt header.
	if got, ok := d.Headers[middleware.AttemptKey]; ok {
		t.Errorf("poison copy carries %s = %v", middleware.AttemptKey, got)
	}
	if n := len(orders.all()); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

// A RetryAfter beyond the cascade's MaxDelay (issue 18 item 8): with 3
// levels of 100 ms (MaxDelay 700 ms) a RetryAfter(1.5s) is held 700 ms, the
// copy carries the remaining 800 ms, the RedeliveryGuard sends it round
// again (700 ms, then 100 ms) without running it: attempt 2 runs no earlier
// than 1.5 s after attempt 1. Before, it came back after 700 ms.
func TestRetryAfterBeyondMaxDelay(t *testing.T) {
	const retryAfter = 1500 * time.Millisecond
	e := newRetryEnv(t, 3, testkit.ExactBackoff(100*time.Millisecond), func(c *cascade.Config) {
		c.Grain, c.Levels = 100*time.Millisecond, 3
	})
	orders := newLog()
	e.handle("orders", func(msg *message.Message) error {
		if s := orders.add(msg); s.attempt == 1 {
			return middleware.RetryAfter(errors.New("rate limited"), retryAfter)
		}
		return nil
	})
	e.start()
	e.publish(message.NewMessage("order-1", []byte("x")))
	first := testkit.Recv(t, orders.ch, 20*time.Second)
	second := testkit.Recv(t, orders.ch, 20*time.Second)
	if first.attempt != 1 || second.attempt != 2 {
		t.Fatalf("attempts %d, %d; want 1, 2", first.attempt, second.attempt)
	}
	gap := second.at.Sub(first.at)
	t.Logf("attempt 2 came %v after attempt 1 (RetryAfter %v, MaxDelay 700ms)", gap.Round(time.Millisecond), retryAfter)
	if gap < retryAfter-7*earlyPerHop { // 3 + 3 + 1 level hops
		t.Errorf("attempt 2 came %v after attempt 1, earlier than the RetryAfter %v", gap, retryAfter)
	}
	if got := second.md.Get(retrymeta.RemainingDelayKey); got != "" {
		t.Errorf("attempt 2 carries %s=%q", retrymeta.RemainingDelayKey, got)
	}
}

// TestModeRefusesBadSettings restores, under Config.Mode, what
// TestConfigRefusesTierModes guarded before the mode became one value (the
// cascade refused together with Tiers, DeadLetterFirstRetry or
// NativeDelayedRetry, naming the field): the cascade Mode is the Retry's
// only delay mechanism (no wait-queue tier declared, Mode "custom"), and
// New refuses, naming the field, the cascade settings the mode cannot use
// (its own Publisher or URI: the Retry's publisher is used) or that are
// invalid (Levels out of range).
func TestModeRefusesBadSettings(t *testing.T) {
	uri := testkit.URI(t)
	prefix := testkit.UniqueName(t, "cascmode")
	newRetry := func(cc cascade.Config) (*amqpretry.Retry, error) {
		return amqpretry.New(amqpretry.Config{URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri), QueueType: amqpretry.QueueTypeQuorum,
			Mode: cascade.Mode(cc), Logger: watermill.NopLogger{}})
	}
	for field, cc := range map[string]cascade.Config{
		"Config.URI":            {Prefix: prefix, URI: uri},
		"cascade.Config.Levels": {Prefix: prefix, Levels: 40},
	} {
		r, err := newRetry(cc)
		if err == nil {
			_ = r.Close()
		}
		if err == nil || !strings.Contains(err.Error(), field) || !strings.Contains(err.Error(), "Config.Mode") {
			t.Errorf("cascade.Mode with a bad %s: err = %v, want an error naming it and Config.Mode", field, err)
		}
	}
	r, err := newRetry(cascade.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if tiers := r.Topology().Tiers(); len(tiers) != 0 {
		t.Errorf("with the cascade, wait-queue tiers %v, want none", tiers)
	}
	if q := r.Topology().WaitQueues("orders"); len(q) != 0 {
		t.Errorf("with the cascade, wait queues %v for orders, want none", q)
	}
}
