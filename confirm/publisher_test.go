package confirm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// publisherConn returns the publisher's current connection.
func publisherConn(t testing.TB, p *Publisher) *amqp.Connection {
	t.Helper()
	p.connMu.Lock()
	defer p.connMu.Unlock()
	if p.conn == nil {
		t.Fatal("publisher has no connection")
	}
	return p.conn.c
}

func TestPublisherConfigValidate(t *testing.T) {
	valid := func() Config {
		c := Config{URI: defaultTestAMQPURI}
		c.setDefaults()
		return c
	}
	if err := valid().Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	c := Config{URI: "amqp://x"}
	c.setDefaults()
	if c.Channels != 2 || c.ConfirmTimeout != 30*time.Second || c.Logger == nil {
		t.Fatalf("defaults not applied: %+v", c)
	}

	cases := []struct {
		name   string
		mutate func(*Config)
		field  string
	}{
		{"no URI no Dial", func(c *Config) { c.URI = "" }, "URI"},
		{"bad URI", func(c *Config) { c.URI = "http://nope" }, "URI"},
		{"zero channels", func(c *Config) { c.Channels = 0 }, "Channels"},
		{"negative channels", func(c *Config) { c.Channels = -1 }, "Channels"},
		{"too many channels", func(c *Config) { c.Channels = 65 }, "Channels"},
		{"negative timeout", func(c *Config) { c.ConfirmTimeout = -time.Second }, "ConfirmTimeout"},
		{"nil logger", func(c *Config) { c.Logger = nil }, "Logger"},
	}
	for _, tc := range cases {
		c := valid()
		tc.mutate(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%s: Validate() = %v, want error naming %s", tc.name, err, tc.field)
		}
	}

	c = valid()
	c.URI = ""
	c.Dial = func() (*amqp.Connection, error) { return nil, errors.New("unused") }
	if err := c.Validate(); err != nil {
		t.Errorf("Dial without URI should be valid: %v", err)
	}

	// New applies defaults, then validates; no panic on bad input.
	if _, err := New(Config{}); err == nil {
		t.Error("New(empty config) succeeded")
	}
	if _, err := New(Config{URI: defaultTestAMQPURI, Channels: 100}); err == nil {
		t.Error("New(Channels=100) succeeded")
	}
	if _, err := New(Config{Dial: func() (*amqp.Connection, error) { return nil, nil }}); err == nil {
		t.Error("New with Dial returning nil connection succeeded")
	}
}

// 2,000 messages from 20 goroutines: all confirmed, all enqueued.
func TestConfirmPublisher_ConcurrentPublishAllConfirmed(t *testing.T) {
	p := newTestPublisher(t, Config{})
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)

	const goroutines, perGoroutine = 20, 100
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, goroutines*perGoroutine)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perGoroutine {
				err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte(fmt.Sprintf("%d-%d", g, i))})
				if err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("publish failed: %v", err)
	}

	conn, err := amqp.Dial(brokerURI(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	want := goroutines * perGoroutine
	var got int
	waitFor(t, 10*time.Second, "queue depth == 2000", func() bool {
		got = queueDepth(t, conn, queue)
		return got == want
	})
	if got != want {
		t.Fatalf("queue depth = %d, want %d", got, want)
	}
}

// Unroutable and routable publishes interleaved on the same channels: exactly
// the unroutable ones fail with ErrUnroutable.
func TestConfirmPublisher_UnroutableNotMisattributed(t *testing.T) {
	for _, channels := range []int{1, 3} {
		t.Run("channels="+strconv.Itoa(channels), func(t *testing.T) {
			p := newTestPublisher(t, Config{Channels: channels})
			ch := testChannel(t)
			queue := uniqueName(t, "rabbitretry.test")
			declareTempQueue(t, ch, queue, nil)
			noRoute := uniqueName(t, "rabbitretry.noroute")

			const n = 200
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			var wg sync.WaitGroup
			routableErrs := make([]error, n)
			unroutableErrs := make([]error, n)
			for i := range n {
				wg.Add(2)
				go func() {
					defer wg.Done()
					routableErrs[i] = p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte("ok-" + strconv.Itoa(i))})
				}()
				go func() {
					defer wg.Done()
					unroutableErrs[i] = p.PublishRaw(ctx, "", noRoute, amqp.Publishing{Body: []byte("lost-" + strconv.Itoa(i))})
				}()
			}
			wg.Wait()
			for i := range n {
				if routableErrs[i] != nil {
					t.Errorf("routable publish %d failed: %v", i, routableErrs[i])
				}
				if !errors.Is(unroutableErrs[i], ErrUnroutable) {
					t.Errorf("unroutable publish %d: err = %v, want ErrUnroutable", i, unroutableErrs[i])
				} else if !strings.Contains(unroutableErrs[i].Error(), noRoute) {
					t.Errorf("unroutable error does not name the routing key: %v", unroutableErrs[i])
				}
			}

			conn, err := amqp.Dial(brokerURI(t))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			waitFor(t, 10*time.Second, "queue depth == 200", func() bool { return queueDepth(t, conn, queue) == n })
		})
	}
}

// A publish to a missing exchange (404 closes the channel) fails, and the
// publisher recovers for the next publishes.
func TestConfirmPublisher_MissingExchangeThenRecovers(t *testing.T) {
	p := newTestPublisher(t, Config{Channels: 1})
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	for round := range 3 {
		err := p.PublishRaw(ctx, uniqueName(t, "rabbitretry.missing"), "k", amqp.Publishing{Body: []byte("x")})
		if err == nil {
			t.Fatalf("round %d: publish to missing exchange succeeded", round)
		}
		var amqpErr *amqp.Error
		if !errors.Is(err, ErrChannelClosed) || !errors.As(err, &amqpErr) || amqpErr.Code != amqp.NotFound {
			t.Fatalf("round %d: err = %v, want ErrChannelClosed wrapping a 404 *amqp.Error", round, err)
		}
		if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte("good")}); err != nil {
			t.Fatalf("round %d: publish after channel error: %v", round, err)
		}
	}
	conn, err := amqp.Dial(brokerURI(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	waitFor(t, 10*time.Second, "queue depth == 3", func() bool { return queueDepth(t, conn, queue) == 3 })
}

// The publish-id header is added to a copy of the headers and is visible on
// the delivered message (the broker cannot strip it).
func TestConfirmPublisher_PublishIDHeaderDelivered(t *testing.T) {
	p := newTestPublisher(t, Config{})
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	callerHeaders := amqp.Table{"x-app": "demo", PublishIDHeader: "caller-value"}
	for range 2 {
		if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Headers: callerHeaders, Body: []byte("b")}); err != nil {
			t.Fatal(err)
		}
	}
	if len(callerHeaders) != 2 || callerHeaders[PublishIDHeader] != "caller-value" {
		t.Fatalf("caller's headers were modified: %v", callerHeaders)
	}
	seen := map[string]bool{}
	for i := range 2 {
		var d amqp.Delivery
		waitFor(t, 10*time.Second, "message available", func() bool {
			var ok bool
			var err error
			d, ok, err = ch.Get(queue, true)
			if err != nil {
				t.Fatal(err)
			}
			return ok
		})
		id, _ := d.Headers[PublishIDHeader].(string)
		if id == "" || id == "caller-value" {
			t.Fatalf("message %d: %s header = %v, want a publisher-generated id", i, PublishIDHeader, d.Headers[PublishIDHeader])
		}
		if seen[id] {
			t.Fatalf("duplicate publish id %q", id)
		}
		seen[id] = true
		if d.Headers["x-app"] != "demo" {
			t.Fatalf("caller header lost: %v", d.Headers)
		}
	}
}

func TestConfirmPublisher_CloseIdleThenPublishReturnsErrClosed(t *testing.T) {
	p, err := New(Config{URI: brokerURI(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	ctx := context.Background()
	if err := p.PublishRaw(ctx, "", "q", amqp.Publishing{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("PublishRaw after Close: %v, want ErrClosed", err)
	}
	if err := p.PublishRawBatch(ctx, "", "q", []amqp.Publishing{{}}); !errors.Is(err, ErrClosed) {
		t.Fatalf("PublishRawBatch after Close: %v, want ErrClosed", err)
	}
	if _, err := p.Channel(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Channel after Close: %v, want ErrClosed", err)
	}
}

// Close while publishes are in flight: no panic, no hang, every publish
// returns nil or an error.
func TestConfirmPublisher_CloseWhilePublishing(t *testing.T) {
	p, err := New(Config{URI: brokerURI(t), ConfirmTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)

	var wg sync.WaitGroup
	var ok, closed atomic.Int64
	started := make(chan struct{})
	var startOnce sync.Once
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				err := p.PublishRaw(context.Background(), "", queue, amqp.Publishing{Body: []byte("x")})
				startOnce.Do(func() { close(started) })
				switch {
				case err == nil:
					ok.Add(1)
				case errors.Is(err, ErrClosed):
					closed.Add(1)
					return
				default:
					t.Errorf("unexpected error: %v", err)
					return
				}
			}
		}()
	}
	<-started
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	wg.Wait()
	if ok.Load() == 0 || closed.Load() == 0 {
		t.Fatalf("ok=%d closed=%d, want both > 0", ok.Load(), closed.Load())
	}
}

func TestConfirmPublisher_Batch(t *testing.T) {
	p := newTestPublisher(t, Config{Channels: 1})
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	msgs := make([]amqp.Publishing, 500)
	for i := range msgs {
		msgs[i] = amqp.Publishing{Body: []byte(strconv.Itoa(i))}
	}
	if err := p.PublishRawBatch(ctx, "", queue, msgs); err != nil {
		t.Fatalf("batch: %v", err)
	}
	if err := p.PublishRawBatch(ctx, "", queue, nil); err != nil {
		t.Fatalf("empty batch: %v", err)
	}
	err := p.PublishRawBatch(ctx, "", uniqueName(t, "rabbitretry.noroute"), msgs[:3])
	if !errors.Is(err, ErrUnroutable) {
		t.Fatalf("unroutable batch: %v, want ErrUnroutable", err)
	}
	// An invalid header fails only its own message.
	bad := []amqp.Publishing{{Body: []byte("a")}, {Headers: amqp.Table{"bad": struct{}{}}}, {Body: []byte("c")}}
	err = p.PublishRawBatch(ctx, "", queue, bad)
	if err == nil || !strings.Contains(err.Error(), "message 1:") || strings.Contains(err.Error(), "message 0:") {
		t.Fatalf("batch with bad header: %v", err)
	}
	if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Headers: amqp.Table{"bad": make(chan int)}}); err == nil {
		t.Fatal("PublishRaw with invalid header succeeded")
	}

	conn, err := amqp.Dial(brokerURI(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	waitFor(t, 10*time.Second, "queue depth == 502", func() bool { return queueDepth(t, conn, queue) == 502 })
}

// A queue with x-overflow=reject-publish makes the broker basic.nack
// publishes once it is full.
func TestConfirmPublisher_Nack(t *testing.T) {
	p := newTestPublisher(t, Config{})
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte("2")})
	if !errors.Is(err, ErrNacked) {
		t.Fatalf("err = %v, want ErrNacked", err)
	}
	if err := p.PublishRaw(ctx, "", uniqueName(t, "rabbitretry.noroute"), amqp.Publishing{}); !errors.Is(err, ErrUnroutable) {
		t.Fatalf("err = %v, want ErrUnroutable", err)
	}
}

func TestConfirmPublisher_ContextAndTimeout(t *testing.T) {
	p := newTestPublisher(t, Config{})
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled ctx: err = %v, want context.Canceled", err)
	}

	// A 1ns confirm timeout expires before any confirm can arrive.
	fast := newTestPublisher(t, Config{ConfirmTimeout: time.Nanosecond})
	var timeouts int
	for range 20 {
		err := fast.PublishRaw(context.Background(), "", queue, amqp.Publishing{})
		switch {
		case errors.Is(err, ErrConfirmTimeout):
			timeouts++
		case err != nil:
			t.Fatalf("unexpected error: %v", err)
		}
	}
	if timeouts == 0 {
		t.Fatal("no ErrConfirmTimeout with ConfirmTimeout=1ns")
	}
	// The publisher still works normally afterwards.
	if err := p.PublishRaw(context.Background(), "", queue, amqp.Publishing{}); err != nil {
		t.Fatal(err)
	}
}

// Losing the connection fails nothing that was confirmed and the next
// publishes succeed without any action by the caller.
func TestConfirmPublisher_RecoversAfterConnectionLoss(t *testing.T) {
	uri := brokerURI(t)
	connName := uniqueName(t, "rabbitretry.conn")
	var mu sync.Mutex
	var conns []*amqp.Connection
	var dials atomic.Int64
	failNextDials := atomic.Int64{}
	p := newTestPublisher(t, Config{Dial: func() (*amqp.Connection, error) {
		dials.Add(1)
		if failNextDials.Load() > 0 {
			failNextDials.Add(-1)
			return nil, errors.New("simulated broker down")
		}
		props := amqp.NewConnectionProperties()
		props.SetClientConnectionName(connName)
		c, err := amqp.DialConfig(uri, amqp.Config{Properties: props})
		if err == nil {
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
		return c, err
	}})
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	publish := func() error { return p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte("x")}) }
	if err := publish(); err != nil {
		t.Fatal(err)
	}

	// 1. Client-side connection loss plus two failed redials (the broker
	// being down for a moment), absorbed by the reconnect backoff.
	mu.Lock()
	first := conns[0]
	mu.Unlock()
	failNextDials.Store(2)
	_ = first.Close()
	for i := range 2 * 2 { // both channels
		if err := publish(); err != nil {
			t.Fatalf("publish %d after connection loss: %v", i, err)
		}
	}
	if dials.Load() < 4 {
		t.Fatalf("dials = %d, want >= 4 (1 initial + 2 failed + 1 successful)", dials.Load())
	}

	// 2. Downtime longer than one publish's reconnect budget: that publish
	// fails, a later one succeeds without any action by the caller.
	mu.Lock()
	cur := conns[len(conns)-1]
	mu.Unlock()
	failNextDials.Store(1000)
	_ = cur.Close()
	if err := publish(); err == nil {
		t.Fatal("publish succeeded while every dial fails")
	} else if !strings.Contains(err.Error(), "simulated broker down") {
		t.Fatalf("publish during downtime: %v, want the dial error", err)
	}
	failNextDials.Store(0)
	for i := range 2 * 2 {
		if err := publish(); err != nil {
			t.Fatalf("publish %d after downtime: %v", i, err)
		}
	}

	// 3. Broker-side close (as on broker shutdown: connection.close 320
	// CONNECTION_FORCED), if rabbitmqctl is available against this broker
	// (testkit.CtlCommand: RABBITRETRY_CTL).
	if testkit.CtlCommand() == "" {
		t.Log("no rabbitmqctl for the broker under test; skipping broker-side connection close")
	} else if pid := findConnectionPid(t, connName); pid == "" {
		t.Log("connection not found via rabbitmqctl (remote broker?); skipping broker-side close")
	} else {
		if _, err := testkit.Ctl(t, 30*time.Second, "close_connection", pid, "rabbitretry test"); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		last := conns[len(conns)-1]
		mu.Unlock()
		waitFor(t, 10*time.Second, "connection closed by broker", last.IsClosed)
		for i := range 2 * 2 {
			if err := publish(); err != nil {
				t.Fatalf("publish %d after broker closed connection: %v", i, err)
			}
		}
	}

	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	minDepth := 9
	waitFor(t, 10*time.Second, "queue has all confirmed messages", func() bool { return queueDepth(t, conn, queue) >= minDepth })
}

// A real broker restart (rabbitmqctl stop_app / start_app). It disrupts every
// client of the broker, so it only runs with RABBITRETRY_TEST_BROKER_RESTART=1
// and a local rabbitmqctl.
func TestConfirmPublisher_SurvivesBrokerRestart(t *testing.T) {
	if os.Getenv("RABBITRETRY_TEST_BROKER_RESTART") != "1" {
		t.Skip("set RABBITRETRY_TEST_BROKER_RESTART=1 to restart the local broker")
	}
	testkit.HaveCtl(t)
	uri := brokerURI(t)
	p := newTestPublisher(t, Config{URI: uri})
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, testChannel(t), queue, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{}); err != nil {
		t.Fatal(err)
	}

	rabbitmqctl := func(args ...string) {
		t.Helper()
		if _, err := testkit.Ctl(t, 3*time.Minute, args...); err != nil {
			t.Fatal(err)
		}
	}
	started := false
	t.Cleanup(func() {
		if !started {
			_, _ = testkit.Ctl(t, 3*time.Minute, "start_app")
		}
	})
	rabbitmqctl("stop_app")
	if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{}); err == nil {
		t.Fatal("publish succeeded while the broker app was stopped")
	} else {
		t.Logf("publish while stopped: %v", err)
	}
	rabbitmqctl("start_app")
	started = true
	rabbitmqctl("await_startup")

	// The non-durable queue did not survive the restart: the publisher must
	// now report it as unroutable, then succeed once it exists again.
	if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{}); !errors.Is(err, ErrUnroutable) {
		t.Fatalf("publish after restart to missing queue: %v, want ErrUnroutable", err)
	}
	ch, err := p.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{}); err != nil {
			t.Fatalf("publish after restart: %v", err)
		}
	}
}

// findConnectionPid returns the Erlang pid of the connection whose
// client-provided connection_name is name, or "".
func findConnectionPid(t testing.TB, name string) string {
	t.Helper()
	var pid string
	// The connection can take a moment to appear in the listing.
	deadline := time.Now().Add(5 * time.Second)
	for pid == "" && time.Now().Before(deadline) {
		out, err := testkit.Ctl(t, 30*time.Second, "-q", "list_connections", "--no-table-headers", "pid", "client_properties")
		if err != nil {
			return ""
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, name) {
				pid = strings.Fields(line)[0]
				break
			}
		}
	}
	return pid
}

// After Close, the publisher's goroutines (per-channel dispatchers,
// connection watchers, amqp091-go readers) are gone, including those of
// channels that died on a channel error.
func TestConfirmPublisher_NoGoroutineLeak(t *testing.T) {
	uri := brokerURI(t)
	before := runtime.NumGoroutine()
	p, err := New(Config{URI: uri, Channels: 4})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 4 {
		_ = p.PublishRaw(ctx, uniqueName(t, "rabbitretry.missing"), "k", amqp.Publishing{})
		_ = p.PublishRaw(ctx, "", uniqueName(t, "rabbitretry.noroute"), amqp.Publishing{})
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	var now int
	waitFor(t, 10*time.Second, "goroutines back to baseline", func() bool {
		now = runtime.NumGoroutine()
		return now <= before
	})
}

func BenchmarkConfirmPublisherParallel(b *testing.B) {
	p := newTestPublisher(b, Config{Channels: 4})
	ch := testChannel(b)
	queue := uniqueName(b, "rabbitretry.bench")
	declareTempQueue(b, ch, queue, amqp.Table{"x-max-length": int32(10000)})
	body := []byte("benchmark payload")
	ctx := context.Background()
	// Several publishers per CPU, so that many confirms are in flight per
	// channel (publishes are pipelined, not serialised on confirms).
	b.SetParallelism(8)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: body}); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// stallingLogger blocks every call, once armed, until release is closed.
type stallingLogger struct {
	armed   atomic.Bool
	calls   atomic.Int64
	once    sync.Once
	stalled chan struct{} // closed by the first call that blocks
	release chan struct{}
	relOnce sync.Once
}

func newStallingLogger(t testing.TB) *stallingLogger {
	l := &stallingLogger{stalled: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(l.unblock)
	return l
}

func (l *stallingLogger) unblock() { l.relOnce.Do(func() { close(l.release) }) }

func (l *stallingLogger) stall() {
	if !l.armed.Load() {
		return
	}
	l.calls.Add(1)
	l.once.Do(func() { close(l.stalled) })
	<-l.release
}

func (l *stallingLogger) Error(string, error, watermill.LogFields) { l.stall() }
func (l *stallingLogger) Info(string, watermill.LogFields)         { l.stall() }
func (l *stallingLogger) Debug(string, watermill.LogFields)        { l.stall() }
func (l *stallingLogger) Trace(string, watermill.LogFields)        { l.stall() }
func (l *stallingLogger) With(watermill.LogFields) watermill.LoggerAdapter {
	return l
}

// amqpReaderStage reports what amqp091-go's connection reader goroutine is
// blocked on, from the goroutine stacks: "confirm" (handing a publisher
// confirm to a NotifyPublish listener), "return" (handing a basic.return to a
// NotifyReturn listener), or "" (neither). amqp091-go drops a notification
// its listener has not taken within 5 s (channel.go, notifyAll).
func amqpReaderStage() string {
	buf := make([]byte, 4<<20)
	n := runtime.Stack(buf, true)
	for _, g := range strings.Split(string(buf[:n]), "\n\n") {
		if !strings.Contains(g, "amqp091-go.notifyAll[") {
			continue
		}
		if strings.Contains(g, "amqp091-go.(*confirms).confirm(") {
			return "confirm"
		}
		if strings.Contains(g, "amqp091-go.(*Channel).dispatch(") {
			return "return"
		}
	}
	return ""
}

// Item 3: a logger that stalls must not turn an unroutable mandatory publish
// into a success. The first publish is abandoned (its ctx ends before its
// confirm), so its basic.return arrives for a publish nobody waits for; the
// library may log that. With the logger stalled, amqp091-go gives up
// delivering the next returns and confirms after 5 s each; the unroutable
// publish that follows must still fail with ErrUnroutable, whatever the
// logger does.
func TestConfirmPublisher_StalledLoggerCannotHideReturn(t *testing.T) {
	logger := newStallingLogger(t)
	p := newTestPublisher(t, Config{Channels: 1, Logger: logger, ConfirmTimeout: time.Minute})
	noRoute := uniqueName(t, "rabbitretry.noroute")
	logger.armed.Store(true)

	// 1. An abandoned unroutable publish (written, then its ctx ended): the
	// write hook ends the publish's ctx right after the write, before the
	// broker's return and confirm can have arrived (on a loaded machine a
	// timed deadline may never fall between the two).
	var cancelAfterWrite atomic.Pointer[context.CancelFunc]
	p.testHookWritten = func() {
		if c := cancelAfterWrite.Swap(nil); c != nil {
			(*c)()
		}
	}
	abandoned := 0
	for i := 0; i < 50 && abandoned == 0; i++ {
		ctx, cancel := context.WithCancel(context.Background())
		cancelAfterWrite.Store(&cancel)
		err := p.PublishRaw(ctx, "", noRoute, amqp.Publishing{Body: []byte("abandoned")})
		cancel()
		if errors.Is(err, context.Canceled) && strings.Contains(err.Error(), "waiting for publisher confirm") {
			abandoned++
		}
	}
	if abandoned == 0 {
		t.Fatal("could not abandon a publish after its write")
	}
	// The library may log the abandoned publish's return; if it does, the
	// logger is now stalled. (If it never logs, nothing is stalled: wait a
	// bounded time for that to happen, then go on.)
	select {
	case <-logger.stalled:
		t.Log("logger stalled on the abandoned publish's return")
	case <-time.After(2 * time.Second):
		t.Log("logger not called for the abandoned publish")
	}

	// 2. The unroutable publish under test.
	res := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		res <- p.PublishRaw(ctx, "", noRoute, amqp.Publishing{Body: []byte("must be reported unroutable")})
	}()
	// Keep the logger stalled until the publish returned, or until
	// amqp091-go has given up on its return and is handing over its confirm
	// (stages after the publish: return, then confirm); then release it.
	var err error
	var stages []string
	deadline := time.Now().Add(40 * time.Second)
wait:
	for {
		select {
		case err = <-res:
			break wait
		default:
		}
		if st := amqpReaderStage(); st != "" && (len(stages) == 0 || stages[len(stages)-1] != st) {
			stages = append(stages, st)
		}
		if n := len(stages); n >= 2 && stages[n-2] == "return" && stages[n-1] == "confirm" {
			t.Logf("amqp091-go dropped the return and is delivering the confirm (stages %v); releasing the logger", stages)
			logger.unblock()
			err = <-res
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("publish did not return within 40 s (reader stages %v)", stages)
		}
		time.Sleep(2 * time.Millisecond) // polling interval, not a synchronisation point
	}
	logger.unblock()
	if !errors.Is(err, ErrUnroutable) {
		t.Fatalf("unroutable mandatory publish with a stalled logger: err = %v, want ErrUnroutable", err)
	}
}

// Item 9: a confirm that arrives exactly when the publish stops waiting
// (its ConfirmTimeout fires, or its ctx ends) must be reported as a success:
// the broker has the message, and a reported failure makes the caller
// publish it again (a duplicate). The hook holds the publish at that moment
// until the broker's confirm has arrived.
func TestConfirmPublisher_ConfirmAtDeadlineIsSuccess(t *testing.T) {
	ch := testChannel(t)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, ch, queue, nil)
	conn, err := amqp.Dial(brokerURI(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	const n = 50
	// confirmArrives is the hook: the deadline has fired; let the confirm
	// arrive before the publish decides.
	var raced atomic.Int64
	confirmArrives := func(confirmed <-chan struct{}) {
		select {
		case <-confirmed:
			raced.Add(1)
		case <-time.After(10 * time.Second):
			t.Error("no confirm within 10 s")
		}
	}

	t.Run("ConfirmTimeout", func(t *testing.T) {
		// 1 ns: the timer always fires before any confirm can arrive.
		p := newTestPublisher(t, Config{Channels: 1, ConfirmTimeout: time.Nanosecond})
		p.testHookGiveUp = confirmArrives
		raced.Store(0)
		for i := range n {
			if err := p.PublishRaw(context.Background(), "", queue, amqp.Publishing{Body: []byte("acked")}); err != nil {
				t.Fatalf("publish %d, acked by the broker, reported as failed: %v", i, err)
			}
		}
		// Now and then the confirm is there before the deadline is seen.
		t.Logf("%d of %d publishes had their confirm arrive at the deadline", raced.Load(), n)
		if raced.Load() == 0 {
			t.Fatal("the deadline never fired before the confirm")
		}
	})
	t.Run("ContextEnds", func(t *testing.T) {
		p := newTestPublisher(t, Config{Channels: 1})
		var cancel context.CancelFunc
		p.testHookWritten = func() { cancel() } // ctx ends right after the write
		p.testHookGiveUp = confirmArrives
		raced.Store(0)
		for i := range n {
			ctx, c := context.WithCancel(context.Background())
			cancel = c
			err := p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte("acked")})
			c()
			if err != nil {
				t.Fatalf("publish %d, acked by the broker, reported as failed: %v", i, err)
			}
		}
		// Now and then the confirm is there before the deadline is seen.
		t.Logf("%d of %d publishes had their confirm arrive at the deadline", raced.Load(), n)
		if raced.Load() == 0 {
			t.Fatal("the deadline never fired before the confirm")
		}
	})
	waitFor(t, 10*time.Second, "every acked message in the queue", func() bool { return queueDepth(t, conn, queue) == 2*n })
}

// Item 12: Config.AmqpConfig is used to dial: its Dial (every
// (re)dial) and Heartbeat.
func TestConfirmPublisher_UsesAmqpConfig(t *testing.T) {
	var dials atomic.Int64
	ac := &amqp.Config{
		Heartbeat: 3 * time.Second,
		Dial: func(network, addr string) (net.Conn, error) {
			dials.Add(1)
			return amqp.DefaultDial(5*time.Second)(network, addr)
		},
	}
	p := newTestPublisher(t, Config{AmqpConfig: ac})
	if dials.Load() == 0 {
		t.Fatal("AmqpConfig.Dial was not used")
	}
	if hb := publisherConn(t, p).Config.Heartbeat; hb != 3*time.Second {
		t.Fatalf("negotiated heartbeat %v, want AmqpConfig.Heartbeat 3s", hb)
	}
}

// A channel whose confirms stop coming (here: the broker's frames are held
// back) must not make later publishes wait for a free in-flight slot
// forever (the Delayer publishes without a ctx deadline): after
// ConfirmTimeout the publish fails with ErrConfirmTimeout without writing,
// the channel is abandoned, and the next publish works on a new one.
func TestConfirmPublisher_UnconfirmedChannelDoesNotHang(t *testing.T) {
	uri := brokerURI(t)
	u, err := amqp.ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	proxy := startStallProxy(t, net.JoinHostPort(u.Host, strconv.Itoa(u.Port)))
	u.Host, u.Port = "127.0.0.1", proxy.port
	p := newTestPublisher(t, Config{URI: u.String(), Channels: 1, ConfirmTimeout: time.Second, maxInFlight: 2})
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, testChannel(t), queue, nil)
	ctx := context.Background()
	publish := func() error { return p.PublishRaw(ctx, "", queue, amqp.Publishing{Body: []byte("x")}) }
	if err := publish(); err != nil {
		t.Fatal(err)
	}

	proxy.stall() // no confirm reaches the publisher
	for i := range 2 {
		if err := publish(); !errors.Is(err, ErrConfirmTimeout) {
			t.Fatalf("publish %d without confirms: %v, want ErrConfirmTimeout", i, err)
		}
	}
	start := time.Now()
	err = publish() // both slots held by the abandoned publishes
	took := time.Since(start)
	if !errors.Is(err, ErrConfirmTimeout) || !strings.Contains(err.Error(), "message not sent") {
		t.Fatalf("publish with every slot held: %v, want ErrConfirmTimeout (message not sent)", err)
	}
	if took > 5*time.Second {
		t.Fatalf("publish with every slot held took %v, want about ConfirmTimeout (1s)", took)
	}
	proxy.resume()
	if err := publish(); err != nil {
		t.Fatalf("publish after the confirms flow again: %v", err)
	}
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// 1 + the 2 abandoned ones (the broker has them) + 1; the refused one was never sent.
	waitFor(t, 10*time.Second, "queue depth == 4", func() bool { return queueDepth(t, conn, queue) == 4 })
}

// stallProxy forwards TCP to target; stall holds back what the broker sends
// (confirms, returns) until resume.
type stallProxy struct {
	port int
	mu   sync.Mutex
	open chan struct{} // closed while traffic flows
}

func (s *stallProxy) gate() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.open
}

func (s *stallProxy) stall() {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.open:
		s.open = make(chan struct{})
	default:
	}
}

func (s *stallProxy) resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.open:
	default:
		close(s.open)
	}
}

func startStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	px := &stallProxy{port: ln.Addr().(*net.TCPAddr).Port, open: make(chan struct{})}
	close(px.open)
	var mu sync.Mutex
	var conns []net.Conn
	var wg sync.WaitGroup
	t.Cleanup(func() {
		px.resume()
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, b)
			mu.Unlock()
			wg.Add(2)
			go func() { defer wg.Done(); _, _ = io.Copy(b, c); _ = b.Close() }()
			go func() {
				defer wg.Done()
				defer c.Close()
				buf := make([]byte, 32<<10)
				for {
					n, err := b.Read(buf)
					if n > 0 {
						<-px.gate()
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return px
}
