package amqpretry_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/poison/admin"
)

// What the forwarder writes is what the poison tools read: List shows the
// failure metadata of messages the real chain poisoned; Replay returns them
// to their queue only (not to the other queue bound with the same key), with
// attempts reset; once the "bug" is fixed they are handled exactly once.
func TestE2E_ForwarderOutputListedAndReplayed(t *testing.T) {
	e := newEnv(t, "classic")
	var fixed atomic.Bool
	var mu sync.Mutex
	handled := map[string]int{}
	attemptsAfterReplay := map[string]int{}
	q := e.handle("mailer", func(msg *message.Message) error {
		if !fixed.Load() {
			return middleware.Permanent(errors.New("mail server rejected domain example.invalid"))
		}
		mu.Lock()
		handled[msg.UUID]++
		attemptsAfterReplay[msg.UUID] = middleware.Attempt(msg)
		mu.Unlock()
		return nil
	})
	other := newRecorder()
	qOther := e.handle("billing", func(msg *message.Message) error { other.record(msg, 1); return nil })
	e.start()
	const n = 20
	sent := map[string]bool{}
	for range n {
		m := message.NewMessage(watermill.NewUUID(), []byte("order"))
		sent[m.UUID] = true
		e.publish(m)
	}
	pq := e.retry.Topology().Naming().PoisonQueue(q)
	waitFor(t, 10*time.Second, "all poisoned", func() bool { return e.depth(pq) == n })

	a, err := admin.New(admin.Config{URI: e.uri})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	list, err := a.List(context.Background(), pq, admin.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != n || e.depth(pq) != n {
		t.Fatalf("listed %d, depth after list %d; want %d, %d", len(list), e.depth(pq), n, n)
	}
	for _, m := range list {
		if !sent[m.UUID] || m.Class != middleware.ClassPermanent || m.Attempts != 1 || m.Handler != "mailer" ||
			m.OriginalQueue != q || m.OriginalExchange != e.exchange || m.OriginalRoutingKey != "order.created" ||
			m.Reason != "mail server rejected domain example.invalid" || m.PoisonedAt.IsZero() || m.FirstFailure.IsZero() {
			t.Fatalf("listed message does not match what the forwarder wrote: %+v", m)
		}
	}

	fixed.Store(true)
	res, err := a.Replay(context.Background(), pq, admin.Filter{ReasonContains: "example.invalid"}, admin.ReplayOptions{})
	if err != nil || res.Replayed != n {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	waitFor(t, 10*time.Second, "replayed messages handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == n
	})
	e.stopRouter()
	for uuid, c := range handled {
		if c != 1 || attemptsAfterReplay[uuid] != 1 {
			t.Errorf("%s handled %d times at attempt %d after replay, want once at attempt 1", uuid, c, attemptsAfterReplay[uuid])
		}
	}
	if e.depth(pq) != 0 || e.depth(q) != 0 {
		t.Errorf("poison depth %d, queue depth %d after replay", e.depth(pq), e.depth(q))
	}
	other.mu.Lock()
	defer other.mu.Unlock()
	if len(other.attempts) != n {
		t.Errorf("the other queue saw %d messages, want %d (each once, never the replays)", len(other.attempts), n)
	}
	for uuid, a := range other.attempts {
		if len(a) != 1 {
			t.Errorf("other queue saw %s %d times", uuid, len(a))
		}
	}
	if d := e.depth(qOther); d != 0 {
		t.Errorf("other queue depth %d", d)
	}
}

// A quorum Q dead-letters what RabbitMQ removes from it (here: a
// per-message TTL that runs out before any consumer runs) into its poison
// queue, with the producer's headers untouched. The poison tools take the
// origin from the broker's x-death record, not from a forged
// rabbitretry-original-queue: Replay returns the message to Q, not to the
// other library-managed queue the header names.
func TestE2E_DeadLetteredIntoPoisonReplaysToItsQueue(t *testing.T) {
	e := newEnv(t, amqpretry.QueueTypeQuorum)
	handled := newRecorder()
	q := e.handle("inbox", func(msg *message.Message) error { handled.record(msg, 1); return nil })
	otherRec := newRecorder()
	other := e.handle("other", func(msg *message.Message) error { otherRec.record(msg, 1); return nil })
	// Declare both queues, then stop consuming so the message expires in Q.
	e.start()
	e.stopRouter()
	m := message.NewMessage(watermill.NewUUID(), []byte("order"))
	m.Metadata.Set(middleware.OriginalQueueKey, other)
	p, err := amqpretry.Marshaler{}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	p.Expiration = "50"
	if err := e.ch.PublishWithContext(context.Background(), e.exchange, "order.created", false, false, p); err != nil {
		t.Fatal(err)
	}
	pq := e.retry.Topology().Naming().PoisonQueue(q)
	waitFor(t, 10*time.Second, "the expired message in Q's poison queue", func() bool { return e.depth(pq) == 1 })
	a, err := admin.New(admin.Config{URI: e.uri})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	list, err := a.List(context.Background(), pq, admin.Filter{})
	if err != nil || len(list) != 1 {
		t.Fatalf("list: %v, %d messages", err, len(list))
	}
	if list[0].OriginalQueue != q || list[0].Class != "dead-lettered:expired" {
		t.Fatalf("listed origin %q class %q, want %q dead-lettered:expired", list[0].OriginalQueue, list[0].Class, q)
	}
	res, err := a.Replay(context.Background(), pq, admin.Filter{}, admin.ReplayOptions{})
	if err != nil || res.Replayed != 1 {
		t.Fatalf("replay: %v, %+v", err, res)
	}
	waitFor(t, 10*time.Second, "the replayed message in Q", func() bool { return e.depth(q) == 1 })
	if d := e.depth(other); d != 0 {
		t.Fatalf("the forged queue got %d message(s)", d)
	}
}
