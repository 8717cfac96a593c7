// Package faults is the fault-injection suite of rabbitretry: broker
// restarts, killed consumers, failing republishes and poison publishes,
// shutdowns, bad input and forged headers. Every scenario ends in an exact
// accounting of the messages it published, logged as one line
//
//	ACCOUNT <test>: published=N handled=N poisoned=N duplicates=N lost=N
//
// where handled counts distinct UUIDs handled successfully, poisoned counts
// distinct UUIDs found in the poison queue and never handled, lost counts
// published UUIDs that are neither (it must be 0), and duplicates counts
// extra completions: every success or poison copy beyond the first one of a
// UUID (at-least-once delivery allows them).
//
// Tests that stop the broker (and so break every other client of a shared
// broker) only run with RABBITRETRY_FAULTS=1 (make test-faults).
package faults

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/router"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

const routingKey = "order.created"

// brokerURI returns $AMQP_URI or the local default; it skips the test when
// no broker answers (fails under CI=true).
func brokerURI(t testing.TB) string {
	t.Helper()
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp.DialConfig(uri, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ unreachable at AMQP_URI: %v", err)
		}
		t.Skipf("RabbitMQ unreachable (set AMQP_URI): %v", err)
	}
	_ = conn.Close()
	return uri
}

// requireDisruptive skips tests that stop the shared broker unless
// RABBITRETRY_FAULTS=1.
func requireDisruptive(t *testing.T) {
	t.Helper()
	if os.Getenv("RABBITRETRY_FAULTS") != "1" {
		t.Skip("stops and restarts the RabbitMQ app, breaking other clients of the broker; run it with `make test-faults` (RABBITRETRY_FAULTS=1)")
	}
}

// requireLong skips the long fault tests (10 s to over a minute each on a
// 2-core machine) unless RABBITRETRY_FAULTS=1, so `make test` stays within
// a few minutes; `make test-brokers` (and so CI) runs every one of them on
// each broker.
func requireLong(t *testing.T) {
	t.Helper()
	if os.Getenv("RABBITRETRY_FAULTS") != "1" {
		t.Skip("long fault test: run it with RABBITRETRY_FAULTS=1 (make test-brokers runs it on every broker)")
	}
}

// poll is waitFor without the failure: it reports whether cond held in time.
func poll(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond) // polling interval, not a synchronisation point
	}
	return true
}

// uniquePrefix is a name prefix unique to this test run, safe for AMQP names.
func uniquePrefix(t testing.TB) string {
	name := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_':
			return r
		}
		return '_'
	}, t.Name())
	if len(name) > 80 {
		name = name[:80]
	}
	return "faults." + name + "." + watermill.NewShortUUID()[:8]
}

// uniqueNaming gives the fault tests their own exchanges, so deleting or
// breaking one never touches the default "rabbitretry.*" exchanges that
// other tests on the same broker use.
func uniqueNaming(prefix string) amqpretry.Naming {
	return amqpretry.Naming{
		LoopBackExchange: prefix + ".loopback",
		WaitExchange:     prefix + ".wait",
		PoisonExchange:   prefix + ".poison",
	}
}

// ---------------------------------------------------------------------------
// admin: a reconnecting side connection for inspection and publishing.

type admin struct {
	t   testing.TB
	uri string

	mu   sync.Mutex
	conn *amqp.Connection
}

func newAdmin(t testing.TB, uri string) *admin {
	a := &admin{t: t, uri: uri}
	t.Cleanup(func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		if a.conn != nil {
			_ = a.conn.Close()
		}
	})
	return a
}

// connection returns a live connection, redialling (for up to 90 s, e.g.
// across a broker restart) when the last one died.
func (a *admin) connection() (*amqp.Connection, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conn != nil && !a.conn.IsClosed() {
		return a.conn, nil
	}
	var err error
	deadline := time.Now().Add(90 * time.Second)
	for {
		a.conn, err = amqp.DialConfig(a.uri, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
		if err == nil {
			return a.conn, nil
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// channel returns a fresh channel; the caller closes it.
func (a *admin) channel() *amqp.Channel {
	a.t.Helper()
	for i := 0; ; i++ {
		c, err := a.connection()
		if err != nil {
			a.t.Fatalf("admin connection: %v", err)
		}
		ch, err := c.Channel()
		if err == nil {
			return ch
		}
		if i == 5 {
			a.t.Fatalf("admin channel: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// depth returns the ready messages of q (-1 if q does not exist).
func (a *admin) depth(q string) int {
	a.t.Helper()
	for i := 0; ; i++ {
		ch := a.channel()
		st, err := ch.QueueDeclarePassive(q, false, false, false, false, nil)
		_ = ch.Close()
		if err == nil {
			return st.Messages
		}
		var aerr *amqp.Error
		if errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
			return -1
		}
		if i == 20 {
			a.t.Fatalf("inspecting %s: %v", q, err)
		}
		time.Sleep(250 * time.Millisecond) // connection lost (broker restart): retry
	}
}

// drain gets and acks every message of q.
func (a *admin) drain(q string) []amqp.Delivery {
	a.t.Helper()
	ch := a.channel()
	defer ch.Close()
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(q, true)
		if err != nil {
			a.t.Fatalf("draining %s: %v", q, err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// publish publishes ps to exchange/key with mandatory set and waits for
// every publisher confirm; an unroutable or nacked message fails the test.
func (a *admin) publish(exchange, key string, ps ...amqp.Publishing) {
	a.t.Helper()
	ch := a.channel()
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		a.t.Fatalf("confirm mode: %v", err)
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, len(ps)+1))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const window = 256
	pending := make([]*amqp.DeferredConfirmation, 0, window)
	flush := func() {
		for _, dc := range pending {
			ok, err := dc.WaitContext(ctx)
			if err != nil || !ok {
				a.t.Fatalf("publish to %s/%s not confirmed: ack=%v err=%v", exchange, key, ok, err)
			}
		}
		pending = pending[:0]
	}
	for _, p := range ps {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, p)
		if err != nil {
			a.t.Fatalf("publish to %s/%s: %v", exchange, key, err)
		}
		pending = append(pending, dc)
		if len(pending) == window {
			flush()
		}
	}
	flush()
	select {
	case r := <-returns:
		a.t.Fatalf("published message returned unroutable: %d %s (exchange %q key %q)", r.ReplyCode, r.ReplyText, r.Exchange, r.RoutingKey)
	default:
	}
}

// deleteAll deletes queues and exchanges, ignoring errors (cleanup).
func (a *admin) deleteAll(queues, exchanges []string) {
	c, err := a.connection()
	if err != nil {
		return
	}
	for _, q := range queues {
		if ch, err := c.Channel(); err == nil {
			_, _ = ch.QueueDelete(q, false, false, false)
			_ = ch.Close()
		}
	}
	for _, ex := range exchanges {
		if ch, err := c.Channel(); err == nil {
			_ = ch.ExchangeDelete(ex, false, false)
			_ = ch.Close()
		}
	}
}

// ---------------------------------------------------------------------------
// env: one business exchange, one originating queue, a Retry, and routers
// that can be started and stopped several times.

type env struct {
	t         *testing.T
	uri       string
	prefix    string
	exchange  string
	queue     string
	queueType string
	naming    amqpretry.Naming
	cfg       amqpretry.Config
	retry     *amqpretry.Retry
	logs      *recLogger
	admin     *admin

	sub    message.Subscriber
	router *message.Router
	// plainSubscriber: consume with watermill-amqp's subscriber as is, not
	// Retry.NewSubscriber's draining one (shutdown nacks in-flight messages).
	plainSubscriber bool
	cancel          context.CancelFunc
	done            chan struct{}

	extraQueues    []string
	extraExchanges []string
}

type envOption func(e *env, c *amqpretry.Config)

// newEnv creates the names and the Retry; the topology is declared when a
// consumer starts (or by declare).
func newEnv(t *testing.T, queueType string, opts ...envOption) *env {
	t.Helper()
	uri := brokerURI(t)
	prefix := uniquePrefix(t)
	e := &env{
		t: t, uri: uri, prefix: prefix, exchange: prefix + ".biz", queue: prefix + ".q",
		queueType: queueType, naming: uniqueNaming(prefix), logs: &recLogger{}, admin: newAdmin(t, uri),
	}
	subCfg := wamqp.NewDurableQueueConfig(uri)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return e.exchange }, Type: "direct", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return routingKey }}
	subCfg.Consume.Qos.PrefetchCount = 16
	// Named, so a test can find it in rabbitmqctl list_connections.
	subCfg.Connection.AmqpConfig = &amqp.Config{Properties: amqp.Table{"connection_name": prefix + ".subscriber"}}
	// Reconnect quickly after a broker restart (default backoff grows to 60 s).
	subCfg.Connection.Reconnect = &wamqp.ReconnectConfig{
		BackoffInitialInterval: 200 * time.Millisecond, BackoffRandomizationFactor: 0.2,
		BackoffMultiplier: 1.5, BackoffMaxInterval: 2 * time.Second,
	}
	e.cfg = amqpretry.Config{
		URI: uri, Subscriber: subCfg, QueueType: queueType, Policy: router.Policy{MaxAttempts: 5, Backoff: exactBackoff(200 * time.Millisecond)},
		Mode:   amqpretry.Tiers(envTiers...),
		Naming: e.naming, Logger: e.logs,
		ConfirmTimeout: 10 * time.Second,
	}
	for _, o := range opts {
		o(e, &e.cfg)
	}
	r, err := amqpretry.New(e.cfg)
	if err != nil {
		t.Fatalf("amqpretry.New: %v", err)
	}
	e.retry = r
	t.Cleanup(e.close)
	return e
}

func (e *env) waitQueues() []string    { return e.retry.Topology().WaitQueues(e.queue) }
func (e *env) poisonQueue() string     { return e.retry.Topology().Naming().PoisonQueue(e.queue) }
func (e *env) quarantineQueue() string { return e.retry.Topology().Naming().QuarantineQueue(e.queue) }
func (e *env) allQueues() []string {
	return append(e.waitQueues(), e.queue, e.poisonQueue(), e.quarantineQueue())
}
func (e *env) depth(q string) int { return e.admin.depth(q) }
func (e *env) poisonDepth() int   { return e.admin.depth(e.poisonQueue()) }

// envTiers are the wait-queue tiers of an env unless an option sets its Mode.
var envTiers = []time.Duration{200 * time.Millisecond, 400 * time.Millisecond}

// native reports whether e's retry mode is amqpretry.NativeDelayed.
func (e *env) native() bool { return e.cfg.Mode != nil && e.cfg.Mode.String() == "native-delayed" }

func (e *env) maxTier() time.Duration { return slices.Max(e.retry.Topology().Tiers()) }

// declare declares the whole topology without consuming.
func (e *env) declare() {
	e.t.Helper()
	sub, err := wamqp.NewSubscriber(e.retry.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(e.queue); err != nil {
		e.t.Fatalf("declaring topology: %v", err)
	}
}

// start runs a fresh subscriber and router consuming e.queue with h.
func (e *env) start(h message.NoPublishHandlerFunc) {
	e.t.Helper()
	if e.cancel != nil {
		e.t.Fatal("consumer already running")
	}
	var sub message.Subscriber
	var err error
	if e.plainSubscriber {
		sub, err = wamqp.NewSubscriber(e.retry.SubscriberConfig(), e.logs.named("subscriber"))
	} else {
		sub, err = e.retry.NewSubscriber(e.logs.named("subscriber"), 10*time.Second)
	}
	if err != nil {
		e.t.Fatal(err)
	}
	rt, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	rt.AddMiddleware(e.retry.Middleware)
	rt.AddConsumerHandler("svc", e.queue, sub, h)
	ctx, cancel := context.WithCancel(context.Background())
	e.sub, e.router, e.cancel, e.done = sub, rt, cancel, make(chan struct{})
	go func() {
		defer close(e.done)
		if err := rt.Run(ctx); err != nil {
			e.t.Errorf("router: %v", err)
		}
	}()
	select {
	case <-rt.Running():
	case <-e.done:
		e.t.Fatal("router stopped before running")
	case <-time.After(30 * time.Second):
		e.t.Fatal("router did not start")
	}
}

// stop closes the router (graceful: handlers in flight finish) and the
// subscriber.
func (e *env) stop() {
	if e.cancel == nil {
		return
	}
	if err := e.router.Close(); err != nil {
		e.t.Errorf("router close: %v", err)
	}
	e.cancel()
	<-e.done
	_ = e.sub.Close()
	e.cancel = nil
}

func (e *env) close() {
	e.stop()
	_ = e.retry.Close()
	e.admin.deleteAll(append(e.allQueues(), e.extraQueues...),
		append([]string{e.exchange, e.naming.LoopBackExchange, e.naming.WaitExchange, e.naming.PoisonExchange}, e.extraExchanges...))
}

// newMessages returns n messages with fresh UUIDs and their publishings.
func newMessages(n int, payload func(i int) []byte) ([]string, []amqp.Publishing) {
	uuids := make([]string, n)
	ps := make([]amqp.Publishing, n)
	for i := range n {
		var body []byte
		if payload != nil {
			body = payload(i)
		} else {
			body = fmt.Appendf(nil, `{"order":%d}`, i)
		}
		m := message.NewMessage(watermill.NewUUID(), body)
		p, err := amqpretry.Marshaler{}.Marshal(m)
		if err != nil {
			panic(err)
		}
		uuids[i], ps[i] = m.UUID, p
	}
	return uuids, ps
}

// publish publishes to the business exchange with the bound routing key.
func (e *env) publish(ps ...amqp.Publishing) {
	e.t.Helper()
	e.admin.publish(e.exchange, routingKey, ps...)
}

// quiet reports whether the originating queue and all wait queues are empty.
func (e *env) quiet() bool {
	for _, q := range append(e.waitQueues(), e.queue) {
		if e.depth(q) != 0 {
			return false
		}
	}
	if e.depth(e.quarantineQueue()) > 0 { // missing (-1) when nothing declared it
		return false
	}
	return true
}

// settle waits until every published message completed (completed() +
// poison depth >= n) and the originating and wait queues stayed empty, with
// completed() and the poison depth unchanged, for longer than the longest
// tier (so no duplicate is still on its way). It reports whether that
// happened within timeout.
func (e *env) settle(n int, completed func() int, timeout time.Duration) bool {
	e.t.Helper()
	window := e.maxTier() + 700*time.Millisecond
	deadline := time.Now().Add(timeout)
	var stableSince time.Time
	last := -1
	for time.Now().Before(deadline) {
		c, p := completed(), e.poisonDepth()
		if c+p >= n && e.quiet() {
			if c+p != last {
				last, stableSince = c+p, time.Now()
			} else if time.Since(stableSince) > window {
				return true
			}
		} else {
			last = -1
		}
		time.Sleep(100 * time.Millisecond)
	}
	return false
}

// checkEmpty fails the test for any message left in the originating queue or
// a wait queue (call it with no consumer running). With NativeDelayedRetry
// it also counts the messages held in Q's delayed state, which a passive
// declare does not report (its count is the ready messages only).
func (e *env) checkEmpty() {
	e.t.Helper()
	for _, q := range append(e.waitQueues(), e.queue) {
		if d := e.depth(q); d != 0 {
			e.t.Errorf("%d message(s) left in %s", d, q)
		}
	}
	if d := e.depth(e.quarantineQueue()); d > 0 {
		e.t.Errorf("%d message(s) left in %s", d, e.quarantineQueue())
	}
	if e.native() {
		// list_queues reports the queue's metrics, emitted every 5 s: a
		// count above 0 may be an old one, so wait for it to reach 0.
		held := -1
		if !poll(15*time.Second, func() bool { held = e.queueMessages(e.queue); return held == 0 }) {
			e.t.Errorf("%d message(s) left in %s (ready, unacknowledged or delayed)", held, e.queue)
		}
	}
}

// queueMessages is q's "messages" as rabbitmqctl list_queues reports it:
// ready, unacknowledged and (quorum queues, 4.3) delayed. -1 if unknown.
func (e *env) queueMessages(q string) int {
	e.t.Helper()
	out, err := rabbitmqctl(e.t, time.Minute, "-q", "list_queues", "name", "messages", "--no-table-headers")
	if err != nil {
		e.t.Errorf("list_queues: %v", err)
		return -1
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == q {
			n, err := strconv.Atoi(f[1])
			if err != nil {
				return -1
			}
			return n
		}
	}
	return -1
}

// poisoned drains the poison queue and returns the count per UUID.
func (e *env) poisoned() (map[string]int, []amqp.Delivery) {
	ds := e.admin.drain(e.poisonQueue())
	m := map[string]int{}
	for _, d := range ds {
		u, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		m[u]++
	}
	return m, ds
}

// ---------------------------------------------------------------------------
// ledger: per-UUID handler bookkeeping, safe for concurrent handlers.

type ledger struct {
	mu       sync.Mutex
	ok       map[string]int // successful handler returns
	attempts map[string][]int
	phantoms []string // deliveries of messages nobody published (see TestSubscriberConnectionDrop)
}

// phantom records a delivery of a message that was never published.
func (l *ledger) phantom(msg *message.Message) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.phantoms = append(l.phantoms, fmt.Sprintf("uuid=%q payload=%dB attempt=%s", msg.UUID, len(msg.Payload), msg.Metadata.Get("rabbitretry-attempt")))
}

func (l *ledger) phantomDeliveries() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.phantoms)
}

func newLedger() *ledger { return &ledger{ok: map[string]int{}, attempts: map[string][]int{}} }

func (l *ledger) attempt(uuid string, n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.attempts[uuid] = append(l.attempts[uuid], n)
	return len(l.attempts[uuid])
}

func (l *ledger) success(uuid string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ok[uuid]++
}

func (l *ledger) handled() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.ok)
}

// awaitingRetry counts the messages that failed at least once and have not
// succeeded yet (retries waiting somewhere, or in a handler now).
func (l *ledger) awaitingRetry() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for u := range l.attempts {
		if l.ok[u] == 0 {
			n++
		}
	}
	return n
}

func (l *ledger) successes() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return cloneMap(l.ok)
}

func (l *ledger) attemptsOf(uuid string) []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.attempts[uuid])
}

func cloneMap(m map[string]int) map[string]int { return maps.Clone(m) }

// accounting is the outcome of one scenario.
type accounting struct {
	Published, Handled, Poisoned, Duplicates, Lost int
	LostUUIDs                                      []string
}

// account computes and logs the ACCOUNT line. handled and poisoned count
// completions per UUID. It fails the test for a lost message and for a UUID
// that was never published.
func account(t testing.TB, published []string, handled, poisoned map[string]int) accounting {
	t.Helper()
	return accountExplained(t, published, handled, poisoned, nil)
}

// accountExplained is account where explain (if not nil) may account for a
// lost message: a lost UUID it returns a reason for is counted as lost and
// logged with that reason, not failed. Only for losses the library
// documents as RabbitMQ's own (classic-queue dead-lettering is
// at-most-once).
func accountExplained(t testing.TB, published []string, handled, poisoned map[string]int, explain func(uuid string) string) accounting {
	t.Helper()
	a := accounting{Published: len(published)}
	pub := make(map[string]bool, len(published))
	for _, u := range published {
		pub[u] = true
	}
	for u := range handled {
		if !pub[u] {
			t.Errorf("handled a UUID that was never published: %q", u)
		}
	}
	for u := range poisoned {
		if !pub[u] {
			t.Errorf("poison queue holds a UUID that was never published: %q", u)
		}
	}
	var lost, unexplained []string
	explained := map[string]int{}
	for _, u := range published {
		h, p := handled[u], poisoned[u]
		switch {
		case h > 0:
			a.Handled++
		case p > 0:
			a.Poisoned++
		default:
			a.Lost++
			lost = append(lost, u)
			why := ""
			if explain != nil {
				why = explain(u)
			}
			if why != "" {
				explained[why]++
			} else {
				unexplained = append(unexplained, u)
			}
		}
		if h+p > 1 {
			a.Duplicates += h + p - 1
		}
	}
	a.LostUUIDs = lost
	note := ""
	for why, n := range explained {
		note += fmt.Sprintf(" (%d %s)", n, why)
	}
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d%s",
		t.Name(), a.Published, a.Handled, a.Poisoned, a.Duplicates, a.Lost, note)
	if n := len(unexplained); n != 0 {
		t.Errorf("%d message(s) lost, e.g. %v", n, unexplained[:min(n, 10)])
	}
	return a
}

// ---------------------------------------------------------------------------
// recLogger records log entries (all levels) for assertions.

type logEntry struct {
	At     time.Time
	Level  string
	Msg    string
	Err    error
	Fields watermill.LogFields
}

type recLogger struct {
	mu      sync.Mutex
	entries []logEntry
	byUUID  map[string]int // message_uuid -> index of its newest entry
	fields  watermill.LogFields
	parent  *recLogger
}

func (l *recLogger) root() *recLogger {
	if l.parent != nil {
		return l.parent
	}
	return l
}

func (l *recLogger) add(level, msg string, err error, fields watermill.LogFields) {
	r := l.root()
	r.mu.Lock()
	defer r.mu.Unlock()
	e := logEntry{At: time.Now(), Level: level, Msg: msg, Err: err, Fields: l.fields.Add(fields)}
	if u, ok := e.Fields["message_uuid"].(string); ok {
		if r.byUUID == nil {
			r.byUUID = map[string]int{}
		}
		r.byUUID[u] = len(r.entries)
	}
	r.entries = append(r.entries, e)
}

func (l *recLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.add("error", msg, err, fields)
}
func (l *recLogger) Info(msg string, fields watermill.LogFields)  { l.add("info", msg, nil, fields) }
func (l *recLogger) Debug(msg string, fields watermill.LogFields) { l.add("debug", msg, nil, fields) }
func (l *recLogger) Trace(msg string, fields watermill.LogFields) {}
func (l *recLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &recLogger{fields: l.fields.Add(fields), parent: l.root()}
}
func (l *recLogger) named(name string) watermill.LoggerAdapter {
	return l.With(watermill.LogFields{"component": name})
}

// trail returns the entries about the message uuid (field message_uuid),
// oldest first, one line each: for a lost message's history.
func (l *recLogger) trail(uuid string) []string {
	r := l.root()
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.entries {
		if e.Fields["message_uuid"] != uuid {
			continue
		}
		line := fmt.Sprintf("%s %s %q %v", e.At.Format("15:04:05.000"), e.Level, e.Msg, e.Fields)
		if e.Err != nil {
			line += " err=" + e.Err.Error()
		}
		out = append(out, line)
	}
	return out
}

// last returns the newest entry about the message uuid (field
// message_uuid).
func (l *recLogger) last(uuid string) (logEntry, bool) {
	r := l.root()
	r.mu.Lock()
	defer r.mu.Unlock()
	i, ok := r.byUUID[uuid]
	if !ok {
		return logEntry{}, false
	}
	return r.entries[i], true
}

// find returns the entries whose message contains substr.
func (l *recLogger) find(level, substr string) []logEntry {
	r := l.root()
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []logEntry
	for _, e := range r.entries {
		if (level == "" || e.Level == level) && strings.Contains(e.Msg, substr) {
			out = append(out, e)
		}
	}
	return out
}

// ---------------------------------------------------------------------------
// rabbitmqctl

// rabbitmqctl runs rabbitmqctl against the broker under test (RABBITRETRY_CTL,
// see internal/testkit), never whatever the machine's default CLI reaches.
func rabbitmqctl(t testing.TB, timeout time.Duration, args ...string) (string, error) {
	t.Helper()
	return testkit.Ctl(t, timeout, args...)
}

func haveRabbitmqctl(t testing.TB) {
	t.Helper()
	testkit.HaveCtl(t)
}

// brokerConnection is one row of rabbitmqctl list_connections.
type brokerConnection struct {
	PID      string // as close_connection wants it: <rabbit@host.N.N.N>
	PeerPort int
	Name     string // client-provided connection_name
}

func listConnections(t testing.TB) []brokerConnection {
	t.Helper()
	// The JSON formatter renders pids as #PID<...>, which close_connection
	// does not take; the plain one has no parseable client_properties. Use
	// both, joined on the peer port.
	out, err := rabbitmqctl(t, 30*time.Second, "-q", "list_connections", "peer_port", "client_properties", "--formatter", "json")
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		PeerPort int `json:"peer_port"`
		// A list, or the string "none" for a connection still in its
		// handshake (another test's).
		ClientProperties json.RawMessage `json:"client_properties"`
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("parsing list_connections: %v\n%s", err, out)
	}
	names := map[int]string{}
	for _, r := range rows {
		// client_properties is a list of [key, type, value] triples.
		var props []json.RawMessage
		_ = json.Unmarshal(r.ClientProperties, &props)
		for _, raw := range props {
			var triple []any
			if json.Unmarshal(raw, &triple) == nil && len(triple) == 3 && triple[0] == "connection_name" {
				names[r.PeerPort], _ = triple[2].(string)
			}
		}
	}
	plain, err := rabbitmqctl(t, 30*time.Second, "-q", "list_connections", "pid", "peer_port")
	if err != nil {
		t.Fatal(err)
	}
	var conns []brokerConnection
	for _, line := range strings.Split(plain, "\n") {
		f := strings.Fields(line)
		if len(f) != 2 || !strings.HasPrefix(f[0], "<") {
			continue
		}
		var port int
		if _, err := fmt.Sscan(f[1], &port); err != nil {
			continue
		}
		conns = append(conns, brokerConnection{PID: f[0], PeerPort: port, Name: names[port]})
	}
	return conns
}

var exactBackoff = testkit.ExactBackoff

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, timeout, what, cond)
}
