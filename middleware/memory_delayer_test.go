package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// recordingPublisher records what it publishes. If block is non-nil, Publish
// signals started and waits for block to be closed.
type recordingPublisher struct {
	mu      sync.Mutex
	topics  []string
	msgs    []*message.Message
	err     error
	block   chan struct{}
	started chan struct{}
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.block != nil {
		p.started <- struct{}{}
		<-p.block
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	for _, m := range msgs {
		p.topics = append(p.topics, topic)
		p.msgs = append(p.msgs, m)
	}
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func (p *recordingPublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.msgs)
}

func fixedTopic(name string) func(context.Context) string {
	return func(context.Context) string { return name }
}

func TestNewMemoryDelayerNilPublisher(t *testing.T) {
	if d, err := middleware.NewMemoryDelayer(nil, nil, nil); err == nil || d != nil {
		t.Fatalf("got %v, %v", d, err)
	}
}

func TestMemoryDelayerPublishesAfterDelay(t *testing.T) {
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer ps.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub, err := ps.Subscribe(ctx, "retry-topic")
	if err != nil {
		t.Fatal(err)
	}
	d, err := middleware.NewMemoryDelayer(ps, fixedTopic("retry-topic"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	delays := []time.Duration{80 * time.Millisecond, 20 * time.Millisecond, 50 * time.Millisecond}
	start := time.Now()
	for i, delay := range delays {
		msg := message.NewMessage(fmt.Sprintf("m%d", i), []byte(fmt.Sprintf("payload %d", i)))
		msg.Metadata.Set("delay", delay.String())
		if err := d.Schedule(context.Background(), msg, delay); err != nil {
			t.Fatal(err)
		}
	}
	if got := d.Pending(); got != 3 {
		t.Fatalf("Pending() = %d right after scheduling, want 3", got)
	}
	// Each arrives no earlier than its delay (gochannel delivers each publish
	// in its own goroutine, so arrival order is not asserted).
	got := map[string]bool{}
	for range delays {
		m := recv(t, sub, 5*time.Second)
		elapsed := time.Since(start)
		m.Ack()
		delay, err := time.ParseDuration(m.Metadata.Get("delay"))
		if err != nil {
			t.Fatal(err)
		}
		if elapsed < delay {
			t.Fatalf("%s arrived after %v, before its delay %v", m.UUID, elapsed, delay)
		}
		if string(m.Payload) != "payload "+m.UUID[1:] {
			t.Fatalf("%s: payload %q", m.UUID, m.Payload)
		}
		if got[m.UUID] {
			t.Fatalf("%s delivered twice", m.UUID)
		}
		got[m.UUID] = true
	}
	waitFor(t, 2*time.Second, func() bool { return d.Pending() == 0 })
	if err := d.Close(); err != nil {
		t.Fatalf("Close with nothing pending: %v", err)
	}
}

func TestMemoryDelayerNegativeDelayPublishesAtOnce(t *testing.T) {
	pub := &recordingPublisher{}
	d, _ := middleware.NewMemoryDelayer(pub, fixedTopic("t"), nil)
	if err := d.Schedule(context.Background(), newMsg("p"), -time.Hour); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Second, func() bool { return pub.count() == 1 })
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestMemoryDelayerTopicFromRouterContext(t *testing.T) {
	pub := &recordingPublisher{}
	d, err := middleware.NewMemoryDelayer(pub, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	// Outside a router there is no subscribe topic.
	err = d.Schedule(context.Background(), newMsg("p"), 0)
	if err == nil {
		t.Fatal("Schedule without a topic must fail")
	}
	if d.Pending() != 0 {
		t.Fatal("failed Schedule left a pending message")
	}

	res := deliverViaRouter(t, "orders", newMsg("p"), func(h message.HandlerFunc) message.HandlerFunc { return h },
		func(*message.Message) ([]*message.Message, error) { return nil, nil })
	msg := newMsg("copy")
	if err := d.Schedule(res.seenCtx, msg, 10*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Second, func() bool { return pub.count() == 1 })
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.topics[0] != "orders" || pub.msgs[0] != msg {
		t.Fatalf("published %q to %q", pub.msgs[0].UUID, pub.topics[0])
	}
}

var droppedRe = regexp.MustCompile(`with (\d+) waiting messages dropped`)

func droppedCount(t *testing.T, err error) int {
	t.Helper()
	if err == nil {
		return 0
	}
	m := droppedRe.FindStringSubmatch(err.Error())
	if m == nil {
		t.Fatalf("Close error %q does not report a count", err)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

func TestMemoryDelayerCloseDropsPending(t *testing.T) {
	pub := &recordingPublisher{}
	d, _ := middleware.NewMemoryDelayer(pub, fixedTopic("t"), nil)
	for range 3 {
		if err := d.Schedule(context.Background(), newMsg("p"), time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	if d.Pending() != 3 {
		t.Fatalf("Pending() = %d", d.Pending())
	}
	err := d.Close()
	if got := droppedCount(t, err); got != 3 {
		t.Fatalf("Close() = %v, want 3 dropped", err)
	}
	if d.Pending() != 0 || pub.count() != 0 {
		t.Fatalf("after Close: pending %d, published %d", d.Pending(), pub.count())
	}
	if err := d.Schedule(context.Background(), newMsg("p"), 0); !errors.Is(err, middleware.ErrClosed) {
		t.Fatalf("Schedule after Close = %v, want ErrClosed", err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("second Close = %v", err)
	}
}

func TestMemoryDelayerCloseWaitsForPublishInProgress(t *testing.T) {
	pub := &recordingPublisher{block: make(chan struct{}), started: make(chan struct{}, 1)}
	d, _ := middleware.NewMemoryDelayer(pub, fixedTopic("t"), nil)
	if err := d.Schedule(context.Background(), newMsg("p"), 0); err != nil {
		t.Fatal(err)
	}
	recv(t, pub.started, 2*time.Second)
	closed := make(chan error, 1)
	go func() { closed <- d.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a publish was in progress", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(pub.block)
	if err := recv(t, closed, 2*time.Second); err != nil {
		t.Fatalf("Close = %v; a publish in progress is not a dropped message", err)
	}
	if pub.count() != 1 {
		t.Fatalf("published %d", pub.count())
	}
}

// Every scheduled message is either published or counted as dropped by Close,
// however Close races with timers firing.
func TestMemoryDelayerCloseAccountsForEveryMessage(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 100 {
		pub := &recordingPublisher{}
		d, _ := middleware.NewMemoryDelayer(pub, fixedTopic("t"), nil)
		const n = 100
		for range n {
			if err := d.Schedule(context.Background(), newMsg("p"), time.Duration(rng.IntN(2000))*time.Microsecond); err != nil {
				t.Fatal(err)
			}
		}
		// Close at once or after a little while, racing the timers.
		if round%2 == 1 {
			waitFor(t, 2*time.Second, func() bool { return pub.count() > 0 })
		}
		dropped := droppedCount(t, d.Close())
		if got := pub.count() + dropped; got != n {
			t.Fatalf("round %d: published %d + dropped %d = %d, want %d", round, pub.count(), dropped, got, n)
		}
		if d.Pending() != 0 {
			t.Fatalf("round %d: Pending() = %d after Close", round, d.Pending())
		}
	}
}

func TestMemoryDelayerPublishFailureLogged(t *testing.T) {
	pub := &recordingPublisher{err: errors.New("pubsub closed")}
	logger := &syncLogger{}
	d, _ := middleware.NewMemoryDelayer(pub, fixedTopic("t"), logger)
	msg := newMsg("p")
	if err := d.Schedule(context.Background(), msg, 5*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Second, func() bool { return len(logger.level("error")) == 1 })
	e := logger.level("error")[0]
	if e.fields["message_uuid"] != msg.UUID || e.fields["topic"] != "t" || e.err == nil {
		t.Fatalf("log entry %+v", e)
	}
	if err := d.Close(); err != nil || d.Pending() != 0 {
		t.Fatalf("Close %v pending %d", err, d.Pending())
	}
}

func TestMemoryDelayerConcurrentSchedule(t *testing.T) {
	var published atomic.Int64
	pub := message.Publisher(&countingPublisher{n: &published})
	d, _ := middleware.NewMemoryDelayer(pub, fixedTopic("t"), nil)
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 25 {
				if err := d.Schedule(context.Background(), newMsg("p"), time.Millisecond); err != nil {
					t.Error(err)
					return
				}
				_ = d.Pending()
			}
		}()
	}
	wg.Wait()
	waitFor(t, 5*time.Second, func() bool { return published.Load() == 500 && d.Pending() == 0 })
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
}

type countingPublisher struct{ n *atomic.Int64 }

func (p *countingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.n.Add(int64(len(msgs)))
	return nil
}
func (p *countingPublisher) Close() error { return nil }
