package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/chainerr"
)

// Header names the bench puts on every message it publishes.
const (
	hdrIndex       = "bench-i"      // message index in its batch
	hdrPublishedNs = "bench-pub-ns" // time.Now().UnixNano() just before the basic.publish
	hdrTierMs      = "bench-tier-ms"
)

// fillWindow is the number of publishes in flight (awaiting their confirm)
// when pre-filling a queue.
const fillWindow = 1024

// padding makes every payload about 128 bytes.
var padding = strings.Repeat("x", 100)

// env is the broker side of the bench: one admin connection used to fill and
// delete queues, and the names of everything a scenario declared.
type env struct {
	uri    string
	prefix string // "bench.<random>": every queue and exchange name starts with it
	logger *errLogger

	mu        sync.Mutex
	admin     *amqp.Connection
	queues    []string
	exchanges []string
}

func newEnv(uri string) (*env, error) {
	conn, err := amqp.Dial(uri)
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w (start the broker with `bash scripts/ensure-broker.sh`)", uri, err)
	}
	return &env{uri: uri, prefix: "bench." + watermill.NewShortUUID()[:8], logger: &errLogger{}, admin: conn}, nil
}

func (e *env) close() { _ = e.admin.Close() }

// name returns a unique queue name "bench.<run>.<parts>".
func (e *env) name(parts ...string) string { return e.prefix + "." + strings.Join(parts, ".") }

// naming gives each amqpretry instance its own exchanges, so nothing the
// bench declares is shared with other users of the broker.
func (e *env) naming(scenario string) amqpretry.Naming {
	p := e.name(scenario)
	e.trackExchanges(p+".loopback", p+".wait", p+".poison")
	return amqpretry.Naming{LoopBackExchange: p + ".loopback", WaitExchange: p + ".wait", PoisonExchange: p + ".poison"}
}

func (e *env) trackQueues(names ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, n := range names {
		if !slices.Contains(e.queues, n) {
			e.queues = append(e.queues, n)
		}
	}
}

func (e *env) trackExchanges(names ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, n := range names {
		if !slices.Contains(e.exchanges, n) {
			e.exchanges = append(e.exchanges, n)
		}
	}
}

// trackRetry records the queues of an amqpretry topology for queue q.
func (e *env) trackRetry(r *amqpretry.Retry, q string) {
	e.trackQueues(q, r.Topology().Naming().PoisonQueue(q), r.Topology().Naming().QuarantineQueue(q))
	e.trackQueues(r.Topology().WaitQueues(q)...)
}

// fillPaced publishes n messages (mk(from), ..., mk(from+n-1)) to q, 10 at
// a time every 50 ms (200 messages over ~1 s), so the scenario measures
// its retry path and not a queue of first attempts the bench itself built.
func (e *env) fillPaced(q string, from, n int, mk func(i int) amqp.Publishing) error {
	const chunk = 10
	for off := from; off < from+n; off += chunk {
		m := min(chunk, from+n-off)
		if _, err := e.fillQueue(q, m, func(i int) amqp.Publishing { return mk(off + i) }); err != nil {
			return err
		}
		time.Sleep(50 * time.Millisecond) // pacing the publisher, not synchronisation
	}
	return nil
}

// retryConsumer builds a Retry from cfg, tracks q's queues for cleanup, and
// opens a watermill-amqp subscriber on the Retry's config with q's topology
// declared. closeAll closes the subscriber, then the Retry.
func (e *env) retryConsumer(cfg amqpretry.Config, q string) (retry *amqpretry.Retry, sub *wamqp.Subscriber, closeAll func(), err error) {
	if retry, err = amqpretry.New(cfg); err != nil {
		return nil, nil, nil, err
	}
	e.trackRetry(retry, q)
	if sub, err = wamqp.NewSubscriber(retry.SubscriberConfig(), e.logger); err != nil {
		_ = retry.Close()
		return nil, nil, nil, err
	}
	closeAll = func() {
		_ = sub.Close()
		_ = retry.Close()
	}
	if err = sub.SubscribeInitialize(q); err != nil {
		closeAll()
		return nil, nil, nil, err
	}
	return retry, sub, closeAll, nil
}

// cleanup deletes every queue and exchange tracked so far. It refuses to
// touch names outside the bench prefix.
func (e *env) cleanup() error {
	e.mu.Lock()
	queues, exchanges := e.queues, e.exchanges
	e.queues, e.exchanges = nil, nil
	e.mu.Unlock()
	var errs []error
	ch, err := e.channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	del := func(kind, n string, f func(*amqp.Channel) error) {
		if !strings.HasPrefix(n, e.prefix+".") {
			errs = append(errs, fmt.Errorf("refusing to delete %s %q outside prefix %s", kind, n, e.prefix))
			return
		}
		if err := f(ch); err != nil {
			errs = append(errs, fmt.Errorf("deleting %s %s: %w", kind, n, err))
			_ = ch.Close()
			if ch, err = e.channel(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, q := range queues {
		del("queue", q, func(ch *amqp.Channel) error { _, err := ch.QueueDelete(q, false, false, false); return err })
	}
	for _, x := range exchanges {
		del("exchange", x, func(ch *amqp.Channel) error { return ch.ExchangeDelete(x, false, false) })
	}
	return errors.Join(errs...)
}

// channel opens a channel on the admin connection, redialling it if needed.
func (e *env) channel() (*amqp.Channel, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.admin.IsClosed() {
		c, err := amqp.Dial(e.uri)
		if err != nil {
			return nil, err
		}
		e.admin = c
	}
	return e.admin.Channel()
}

// queueLen returns the number of ready messages in q (passive declare).
func (e *env) queueLen(q string) (int, error) {
	ch, err := e.channel()
	if err != nil {
		return 0, err
	}
	defer func() { _ = ch.Close() }()
	st, err := ch.QueueDeclarePassive(q, false, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	return st.Messages, nil
}

// benchPublishing is message i as a watermill-amqp publisher would send it:
// the Watermill UUID header, a persistent ~128-byte JSON body, plus the
// publish timestamp, set at publish, for latency measurements.
func benchPublishing(i int, extra amqp.Table) amqp.Publishing {
	h := amqp.Table{
		wamqp.DefaultMessageUUIDHeaderKey: watermill.NewUUID(),
		hdrIndex:                          strconv.Itoa(i),
	}
	for k, v := range extra {
		h[k] = v
	}
	return amqp.Publishing{
		Headers:      h,
		DeliveryMode: amqp.Persistent,
		Body:         fmt.Appendf(nil, `{"id":%d,"pad":"%s"}`, i, padding),
	}
}

// fill publishes n messages to exchange/key with publisher confirms,
// pipelined: up to fillWindow publishes await their confirm at once. mk
// builds message i; the publish timestamp header is set just before each
// basic.publish. It returns once every message is confirmed.
func fill(conn *amqp.Connection, exchange, key string, n int, mk func(i int) amqp.Publishing) (time.Duration, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	defer func() { _ = ch.Close() }()
	if err := ch.Confirm(false); err != nil {
		return 0, err
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, fillWindow))
	start := time.Now()
	outstanding := 0
	await := func() error {
		c, ok := <-confirms
		if !ok {
			return errors.New("channel closed while waiting for confirms")
		}
		if !c.Ack {
			return fmt.Errorf("publish %d nacked by the broker", c.DeliveryTag)
		}
		outstanding--
		return nil
	}
	for i := range n {
		if outstanding >= fillWindow {
			if err := await(); err != nil {
				return 0, err
			}
		}
		p := mk(i)
		if p.Headers == nil {
			p.Headers = amqp.Table{}
		}
		p.Headers[hdrPublishedNs] = strconv.FormatInt(time.Now().UnixNano(), 10)
		if err := ch.PublishWithContext(context.Background(), exchange, key, false, false, p); err != nil {
			return 0, err
		}
		outstanding++
	}
	for outstanding > 0 {
		if err := await(); err != nil {
			return 0, err
		}
	}
	return time.Since(start), nil
}

// fillQueue fills queue q through the default exchange.
func (e *env) fillQueue(q string, n int, mk func(i int) amqp.Publishing) (time.Duration, error) {
	e.mu.Lock()
	conn := e.admin
	e.mu.Unlock()
	return fill(conn, "", q, n, mk)
}

// ---------------------------------------------------------------------------
// Watermill router harness

// consumer describes the router a scenario runs: handlers handlers (each its
// own watermill-amqp subscription, i.e. its own AMQP channel and consumer) on
// the same topic, with the given router-level middlewares.
type consumer struct {
	sub         message.Subscriber
	topic       string
	handlers    int
	middlewares []message.HandlerMiddleware
	handler     message.NoPublishHandlerFunc
}

type runningRouter struct {
	r    *message.Router
	errc chan error
}

func (e *env) startRouter(c consumer) (*runningRouter, error) {
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, e.logger)
	if err != nil {
		return nil, err
	}
	r.AddMiddleware(c.middlewares...)
	for i := range max(c.handlers, 1) {
		r.AddConsumerHandler(fmt.Sprintf("h%d", i), c.topic, c.sub, c.handler)
	}
	rr := &runningRouter{r: r, errc: make(chan error, 1)}
	go func() { rr.errc <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
		return rr, nil
	case err := <-rr.errc:
		return nil, fmt.Errorf("router stopped at start: %w", err)
	case <-time.After(30 * time.Second):
		_ = r.Close()
		return nil, errors.New("router did not start within 30s")
	}
}

func (rr *runningRouter) close() error {
	err := rr.r.Close()
	select {
	case rerr := <-rr.errc:
		return errors.Join(err, rerr)
	case <-time.After(20 * time.Second):
		return errors.Join(err, errors.New("router Run did not return within 20s of Close"))
	}
}

// ---------------------------------------------------------------------------
// Measurement helpers

// tracker counts events and remembers the first and last event time
// (monotonic, relative to its creation).
type tracker struct {
	base   time.Time
	target int64
	count  atomic.Int64
	first  atomic.Int64 // ns since base + 1 (0 = unset)
	last   atomic.Int64
	done   chan struct{}
	once   sync.Once
}

func newTracker(target int) *tracker {
	return &tracker{base: time.Now(), target: int64(target), done: make(chan struct{})}
}

func (t *tracker) hit() {
	now := int64(time.Since(t.base)) + 1
	t.first.CompareAndSwap(0, now)
	for {
		l := t.last.Load()
		if now <= l || t.last.CompareAndSwap(l, now) {
			break
		}
	}
	if t.count.Add(1) == t.target {
		t.once.Do(func() { close(t.done) })
	}
}

// span is the time from the first to the last event.
func (t *tracker) span() time.Duration { return time.Duration(t.last.Load() - t.first.Load()) }

// rate is events per second between the first and the last event.
func (t *tracker) rate() float64 {
	n := t.count.Load()
	if n < 2 || t.span() <= 0 {
		return 0
	}
	return float64(n-1) / t.span().Seconds()
}

func (t *tracker) wait(timeout time.Duration, what string) error {
	select {
	case <-t.done:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("%s: only %d of %d after %v", what, t.count.Load(), t.target, timeout)
	}
}

// percentile returns the p-th percentile (nearest rank) of sorted xs.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p/100*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// vmRSS reads VmRSS of this process from /proc/self/status, in bytes.
func vmRSS() (int64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer func() { _ = f.Close() }()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			fields := strings.Fields(rest) // "12345 kB"
			if len(fields) >= 1 {
				kb, err := strconv.ParseInt(fields[0], 10, 64)
				return kb * 1024, err
			}
		}
	}
	return 0, errors.New("VmRSS not found in /proc/self/status")
}

// publishedAt reads the publish timestamp header of a consumed message.
func publishedAt(msg *message.Message) (time.Time, bool) {
	ns, err := strconv.ParseInt(msg.Metadata.Get(hdrPublishedNs), 10, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.Unix(0, ns), true
}

// errLogger is a Watermill logger that prints errors only (and counts them).
// The router logs every handler error, and with DeadLetterFirstRetry or
// NativeDelayedRetry a retry is a handler error (a
// *chainerr.DeadLetterRetryError: the nack that follows is the retry), so
// those are counted apart and not printed: they are the bench's own
// failures, tens of thousands in the memory scenario.
type errLogger struct {
	errors  atomic.Int64
	retries atomic.Int64 // *chainerr.DeadLetterRetryError: retries by nack
	quiet   atomic.Bool
}

func (l *errLogger) Error(msg string, err error, fields watermill.LogFields) {
	if _, ok := errors.AsType[*chainerr.DeadLetterRetryError](err); ok {
		l.retries.Add(1)
		return
	}
	l.errors.Add(1)
	if !l.quiet.Load() {
		fmt.Fprintf(os.Stderr, "  [watermill error] %s: %v %v\n", msg, err, fields)
	}
}
func (l *errLogger) Info(string, watermill.LogFields)  {}
func (l *errLogger) Debug(string, watermill.LogFields) {}
func (l *errLogger) Trace(string, watermill.LogFields) {}
func (l *errLogger) With(watermill.LogFields) watermill.LoggerAdapter {
	return l
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s  "+format+"\n", append([]any{time.Now().Format("15:04:05.000")}, args...)...)
}

// cpuTime is the user+system CPU time this process used so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
