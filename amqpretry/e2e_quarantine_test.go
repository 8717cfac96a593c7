package amqpretry_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/router"
)

// Issue 18 item 2, with the default config (crash quarantine on): graceful
// stops while messages wait in the quarantine queue never charge them a
// redelivery, and duplicate or lose nothing. The quarantined messages carry
// rabbitretry-redeliveries MaxRedeliveries-1, so a single charged
// redelivery would poison one; slow origin messages keep the handler busy
// so that quarantine messages wait behind them when each stop comes. The
// origin messages a stop returns from the prefetch buffer (redelivered) are
// moved to the quarantine uncounted and run there with count 0.
func TestE2E_QuarantineGracefulStop(t *testing.T) {
	const (
		maxRedeliveries = 3
		nQuarantine     = 6
		nOrigin         = 24
		stops           = 5
	)
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) {
		c.Subscriber.Consume.Qos.PrefetchCount = 4
		c.MaxRedeliveries = maxRedeliveries
	})
	q := e.queue("svc")
	topo := e.retry.Topology()
	qq := topo.Naming().QuarantineQueue(q)

	var (
		mu      sync.Mutex
		runs    = map[string]int{}
		redeliv = map[string]int{}
		handled = map[string]bool{}
	)
	handler := func(msg *message.Message) error {
		if string(msg.Payload) == "slow" {
			select { // a slow handler: the work, not synchronisation
			case <-time.After(150 * time.Millisecond):
			case <-msg.Context().Done():
			}
		}
		mu.Lock()
		defer mu.Unlock()
		runs[msg.UUID]++
		redeliv[msg.UUID] = max(redeliv[msg.UUID], retrymeta.Redeliveries(msg))
		handled[msg.UUID] = true
		return nil
	}
	nHandled := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(handled)
	}
	start := func() (stop func()) {
		sub, err := e.retry.NewSubscriber(watermill.NopLogger{}, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		rt, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		rt.AddMiddleware(e.retry.Middleware)
		rt.AddConsumerHandler("svc", q, sub, handler)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			if err := rt.Run(ctx); err != nil {
				t.Errorf("router: %v", err)
			}
		}()
		select {
		case <-rt.Running():
		case <-time.After(20 * time.Second):
			t.Fatal("router did not start")
		}
		return func() {
			if err := rt.Close(); err != nil {
				t.Errorf("router close: %v", err)
			}
			cancel()
			<-done
			_ = sub.Close()
		}
	}

	// The topology (the quarantine queue included), then the messages.
	stop := start()
	stop()
	var quarantined []string
	for i := range nQuarantine {
		m := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"quarantined":%d}`, i))
		m.Metadata.Set(retrymeta.RedeliveriesKey, strconv.Itoa(maxRedeliveries-1))
		p, err := amqpretry.Marshaler{}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.ch.PublishWithContext(context.Background(), "", qq, true, false, p); err != nil {
			t.Fatal(err)
		}
		quarantined = append(quarantined, m.UUID)
	}
	var origin []*message.Message
	for range nOrigin {
		origin = append(origin, message.NewMessage(watermill.NewUUID(), []byte("slow")))
	}
	e.publish(origin...)

	// Stops mid-run: each once the handler has made some progress.
	for i := range stops {
		before := nHandled()
		stop := start()
		waitFor(t, 30*time.Second, "progress before a stop", func() bool { return nHandled() >= before+2 })
		stop()
		t.Logf("stop %d: handled %d, quarantine depth %d, origin depth %d", i+1, nHandled(), e.depth(qq), e.depth(q))
	}
	stop = start()
	total := nQuarantine + nOrigin
	waitFor(t, 60*time.Second, "every message handled", func() bool {
		return nHandled()+e.depth(topo.Naming().PoisonQueue(q)) >= total && e.depth(qq) == 0 && e.depth(q) == 0
	})
	stop()

	poisoned := e.drain(topo.Naming().PoisonQueue(q))
	mu.Lock()
	defer mu.Unlock()
	dups := 0
	for _, n := range runs {
		dups += n - 1
	}
	lost := total - len(handled) - len(poisoned)
	t.Logf("ACCOUNT TestE2E_QuarantineGracefulStop: published=%d handled=%d poisoned=%d duplicates=%d lost=%d (%d graceful stops)",
		total, len(handled), len(poisoned), dups, lost, stops)
	if len(poisoned) != 0 || dups != 0 || lost != 0 || len(handled) != total {
		t.Errorf("want every message handled once, none poisoned")
	}
	for _, m := range origin {
		if redeliv[m.UUID] != 0 {
			t.Errorf("origin message %s ran with redelivery count %d, want 0 (not charged by a stop)", m.UUID, redeliv[m.UUID])
		}
	}
	for _, u := range quarantined {
		if redeliv[u] != maxRedeliveries-1 {
			t.Errorf("quarantined %s ran with redelivery count %d, want %d (not charged by a stop)", u, redeliv[u], maxRedeliveries-1)
		}
	}
	if d := e.depth(qq); d != 0 {
		t.Errorf("quarantine queue still holds %d", d)
	}
}

// A quarantine message that is fetched but not run goes back unchanged and
// uncounted: nacked by the router, or still unread when the subscriber
// closes. Exactly one copy is left in the quarantine queue each time (no
// duplicate), without the redelivered flag, with its redelivery count.
func TestE2E_QuarantineHandBack(t *testing.T) {
	e := newEnv(t, amqpretry.QueueTypeQuorum)
	q := e.queue("svc")
	qq := e.retry.Topology().Naming().QuarantineQueue(q)
	newSub := func() (*router.DrainingSubscriber, <-chan *message.Message) {
		sub, err := e.retry.NewSubscriber(watermill.NopLogger{}, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if err := sub.SubscribeInitialize(q); err != nil {
			t.Fatal(err)
		}
		ch, err := sub.Subscribe(context.Background(), q)
		if err != nil {
			t.Fatal(err)
		}
		return sub, ch
	}
	sub, in := newSub()
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"x":1}`))
	m.Metadata.Set(retrymeta.RedeliveriesKey, "2")
	p, err := amqpretry.Marshaler{}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.ch.PublishWithContext(context.Background(), "", qq, true, false, p); err != nil {
		t.Fatal(err)
	}
	check := func(got *message.Message, what string) {
		t.Helper()
		if got.UUID != m.UUID || got.Metadata.Get(retrymeta.DeliveryQuarantineKey) != "true" ||
			got.Metadata.Get(retrymeta.DeliveryRedeliveredKey) != "" || got.Metadata.Get(retrymeta.RedeliveriesKey) != "2" {
			t.Fatalf("%s: uuid %s, metadata %v", what, got.UUID, got.Metadata)
		}
	}
	// 1. Nacked: handed back.
	got := testkit.Recv(t, in, 10*time.Second)
	check(got, "first fetch")
	got.Nack()
	// 2. Fetched again, as it was; then the subscriber closes before
	// anyone takes the next fetch.
	got = testkit.Recv(t, in, 10*time.Second)
	check(got, "after the nack")
	got.Nack()
	waitFor(t, 10*time.Second, "the hand-back fetched again", func() bool { return e.depth(qq) == 0 })
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	if d := e.depth(qq); d != 1 {
		t.Fatalf("quarantine depth %d after the stop, want 1 (no duplicate, nothing lost)", d)
	}
	// 3. A new subscriber runs it: not redelivered, count unchanged.
	sub, in = newSub()
	got = testkit.Recv(t, in, 10*time.Second)
	check(got, "after the stop")
	got.Ack()
	waitFor(t, 10*time.Second, "the ack", func() bool { return e.depth(qq) == 0 })
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	if d := e.depth(qq); d != 0 {
		t.Fatalf("quarantine depth %d after the ack", d)
	}
	t.Logf("ACCOUNT TestE2E_QuarantineHandBack: published=1 handled=1 poisoned=0 duplicates=0 lost=0 (1 nack, 1 stop with the message fetched and unread)")
}
