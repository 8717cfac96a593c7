package router_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// poisonRecorder publishes to a gochannel "poison" topic and records every
// Publish synchronously, so counts are exact when the handler returns.
type poisonRecorder struct {
	message.Publisher
	mu     sync.Mutex
	msgs   []*message.Message
	topics []string
}

func (p *poisonRecorder) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	for range msgs {
		p.topics = append(p.topics, topic)
	}
	return nil
}

func (p *poisonRecorder) all() []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*message.Message(nil), p.msgs...)
}

// event is what a recording Observer saw.
type event struct {
	kind    string
	uuid    string
	attempt int
	delay   time.Duration
	class   string
}

type recObserver struct {
	mu     sync.Mutex
	events []event
}

func (o *recObserver) add(e event) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.events = append(o.events, e)
}
func (o *recObserver) RetryScheduled(msg *message.Message, attempt int, delay, _ time.Duration) {
	o.add(event{kind: "retry", uuid: msg.UUID, attempt: attempt, delay: delay})
}
func (o *recObserver) RetryFailed(msg *message.Message, attempt int, _ error) {
	o.add(event{kind: "retry-failed", uuid: msg.UUID, attempt: attempt})
}
func (o *recObserver) Poisoned(msg *message.Message, attempt int, class string) {
	o.add(event{kind: "poisoned", uuid: msg.UUID, attempt: attempt, class: class})
}
func (o *recObserver) PoisonFailed(msg *message.Message, attempt int, _ error) {
	o.add(event{kind: "poison-failed", uuid: msg.UUID, attempt: attempt})
}
func (o *recObserver) Dropped(msg *message.Message, attempt int) {
	o.add(event{kind: "dropped", uuid: msg.UUID, attempt: attempt})
}

func (o *recObserver) count(kind string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, e := range o.events {
		if e.kind == kind {
			n++
		}
	}
	return n
}

func (o *recObserver) of(kind string) []event {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []event
	for _, e := range o.events {
		if e.kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// env is a gochannel + message.Router + retry chain test bed. Messages are
// consumed from topic "orders" by handler "worker"; retry copies wait in a
// MemoryDelayer that republishes to "orders"; poisoned messages go to the
// "poison" topic of a second gochannel.
type env struct {
	in       *gochannel.GoChannel
	poisonPS *gochannel.GoChannel
	poison   *poisonRecorder
	poisonCh <-chan *message.Message
	delayer  *middleware.MemoryDelayer
	chain    *router.Chain
	router   *message.Router
	observer *recObserver
	runErr   chan error
}

const topic = "orders"

// newEnv starts the router. cfg.Delayer, PoisonPublisher and Observer are
// filled in; a zero Backoff becomes exactBackoff(20ms).
func newEnv(t *testing.T, cfg router.Config, h message.HandlerFunc, inner ...message.HandlerMiddleware) *env {
	t.Helper()
	return newEnvWrapped(t, cfg, nil, h, inner...)
}

// newEnvWrapped is newEnv with the chain's Delayer wrap(MemoryDelayer) when
// wrap is not nil.
func newEnvWrapped(t *testing.T, cfg router.Config, wrap func(middleware.Delayer) middleware.Delayer, h message.HandlerFunc, inner ...message.HandlerMiddleware) *env {
	t.Helper()
	e := &env{observer: &recObserver{}, runErr: make(chan error, 1)}
	e.in = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024}, watermill.NopLogger{})
	e.poisonPS = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 1024, Persistent: true}, watermill.NopLogger{})
	e.poison = &poisonRecorder{Publisher: e.poisonPS}
	ctx, cancel := context.WithCancel(context.Background())
	var err error
	e.poisonCh, err = e.poisonPS.Subscribe(ctx, "poison")
	if err != nil {
		t.Fatal(err)
	}
	e.delayer, err = middleware.NewMemoryDelayer(e.in, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Delayer = e.delayer
	if wrap != nil {
		cfg.Delayer = wrap(e.delayer)
	}
	cfg.PoisonPublisher = e.poison
	if cfg.Observer == nil {
		cfg.Observer = e.observer
	}
	if cfg.Backoff == nil {
		cfg.Backoff = exactBackoff(20 * time.Millisecond)
	}
	e.chain, err = router.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	e.chain.AddTo(e.router, inner...)
	e.router.AddConsumerHandler("worker", topic, e.in, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	go func() { e.runErr <- e.router.Run(context.Background()) }()
	recv(t, e.router.Running(), 5*time.Second)
	t.Cleanup(func() {
		e.closeRouter(t)
		_ = e.delayer.Close()
		cancel()
		_ = e.poisonPS.Close()
		_ = e.in.Close()
	})
	return e
}

// closeRouter closes the router and waits for Run to return.
func (e *env) closeRouter(t *testing.T) {
	t.Helper()
	if e.router.IsClosed() {
		return
	}
	if err := e.router.Close(); err != nil {
		t.Errorf("router Close: %v", err)
	}
	if err := recv(t, e.runErr, 5*time.Second); err != nil {
		t.Errorf("router Run: %v", err)
	}
}

func (e *env) publish(t *testing.T, msgs ...*message.Message) {
	t.Helper()
	if err := e.in.Publish(topic, msgs...); err != nil {
		t.Fatal(err)
	}
}

// call is one handler invocation.
type call struct {
	uuid    string
	attempt int
	at      time.Time
	md      message.Metadata
}

// calls records handler invocations.
type calls struct {
	mu   sync.Mutex
	list []call
}

func (c *calls) record(msg *message.Message) call {
	md := make(message.Metadata, len(msg.Metadata))
	for k, v := range msg.Metadata {
		md[k] = v
	}
	cl := call{uuid: msg.UUID, attempt: middleware.Attempt(msg), at: time.Now(), md: md}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.list = append(c.list, cl)
	return cl
}

func (c *calls) get() []call {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]call(nil), c.list...)
}

func (c *calls) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.list)
}

var errTransient = errors.New("service unavailable")

// fakeDelayer counts Schedule calls and returns err.
type fakeDelayer struct {
	n         atomic.Int64
	last      *message.Message
	lastDelay time.Duration
	err       error
}

func (d *fakeDelayer) Schedule(_ context.Context, msg *message.Message, delay time.Duration) error {
	d.n.Add(1)
	d.last, d.lastDelay = msg, delay
	return d.err
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

type failingPublisher struct{}

func (failingPublisher) Publish(string, ...*message.Message) error {
	return errors.New("poison broker down")
}
func (failingPublisher) Close() error { return nil }

// waitFor polls cond until it holds, failing after timeout.
func waitFor(t testing.TB, timeout time.Duration, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, timeout, "condition", cond)
}

func recv[T any](t testing.TB, ch <-chan T, timeout time.Duration) T {
	t.Helper()
	return testkit.Recv(t, ch, timeout)
}

var exactBackoff = testkit.ExactBackoff
