package audit_test

import (
	"context"
	"fmt"
	"maps"
	"net"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/audittest"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// dropper records the TCP connections a Consumer dials, so a test can
// drop them (a connection loss as the broker sees it: every unacked
// delivery is returned and counted, "Quorum Queues", "When is delivery
// count incremented?").
type dropper struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (d *dropper) config() *amqp.Config {
	dial := amqp.DefaultDial(10 * time.Second)
	return &amqp.Config{Heartbeat: 10 * time.Second, Dial: func(network, addr string) (net.Conn, error) {
		c, err := dial(network, addr)
		if err == nil {
			d.mu.Lock()
			d.conns = append(d.conns, c)
			d.mu.Unlock()
		}
		return c, err
	}}
}

// drop closes every connection dialled so far and returns how many.
func (d *dropper) drop() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := len(d.conns)
	for _, c := range d.conns {
		_ = c.Close()
	}
	d.conns = nil
	return n
}

// offerStore remembers the arrival IDs offered to Write since reset.
type offerStore struct {
	*audittest.MemoryStore
	mu   sync.Mutex
	seen map[string]bool
}

func (s *offerStore) Write(ctx context.Context, arr []audit.Arrival, att []audit.Attempt) error {
	s.mu.Lock()
	if s.seen == nil {
		s.seen = map[string]bool{}
	}
	for _, a := range arr {
		s.seen[a.ID] = true
	}
	s.mu.Unlock()
	return s.MemoryStore.Write(ctx, arr, att)
}

func (s *offerStore) offered() map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.seen)
}

func (s *offerStore) reset() {
	s.mu.Lock()
	s.seen = nil
	s.mu.Unlock()
}

// TestConsumerHoldsRecordsThroughConnectionLosses: PostgreSQL is down, the
// consumer holds 200 arrivals unacked, and its connection is closed over
// and over (100 times, the TCP connection dropped). Each close counts
// as a delivery of every held record (quorum queue delivery-count); on 4.x
// the default delivery limit (20) used to drop them all. The audit queues
// now carry a large delivery limit (audit.DeliveryLimit) and a dead-letter
// target, so every record is stored once the store is back.
func TestConsumerHoldsRecordsThroughConnectionLosses(t *testing.T) {
	holdThroughLosses(t, newBrokerEnv(t), 100)
}

// TestConsumerUpgradedQueuesHoldRecords: audit queues declared by an older
// version (quorum, no arguments: RabbitMQ cannot change them) get the
// README's upgrade policy (delivery-limit, dead-letter target); the
// Consumer uses them as they are, and they too keep every record through
// 100 connection losses. Without the policy RabbitMQ 4.x drops them all
// after 20.
func TestConsumerUpgradedQueuesHoldRecords(t *testing.T) {
	testkit.HaveCtl(t)
	e := newBrokerEnv(t)
	for _, q := range []string{e.naming.ArrivalsQueue, e.naming.AttemptsQueue} {
		if _, err := e.ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			t.Fatal(err)
		}
	}
	applyUpgradePolicy(t, e, audit.DeliveryLimit)
	holdThroughLosses(t, e, 100)
}

// applyUpgradePolicy sets the README's upgrade policy (with delivery-limit
// limit) on e's arrivals and attempts queues, cleared at the end.
func applyUpgradePolicy(t *testing.T, e *brokerEnv, limit int) {
	t.Helper()
	n := e.naming.WithDefaults()
	def := fmt.Sprintf(`{"delivery-limit":%d,"dead-letter-exchange":%q,"dead-letter-routing-key":%q,"dead-letter-strategy":"at-least-once","overflow":"reject-publish"}`,
		limit, n.Exchange, audit.SetAsideRoutingKey)
	pattern := "^" + regexp.QuoteMeta(e.prefix) + `\.(arrivals|attempts)$`
	if _, err := testkit.Ctl(t, 60*time.Second, "set_policy", "--apply-to", "queues", "--priority", "10", e.prefix, pattern, def); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testkit.Ctl(t, 60*time.Second, "clear_policy", e.prefix) })
}

// holdThroughLosses publishes 200 messages while the store is down, drops
// the consumer's connection closes times, then brings the store back and
// accounts for every record.
func holdThroughLosses(t *testing.T, e *brokerEnv, closes int) {
	t.Helper()
	store := &offerStore{MemoryStore: audittest.NewMemoryStore()}
	store.SetDown(true)
	var d dropper
	_, _ = e.consumer(store, func(cfg *audit.ConsumerConfig) {
		cfg.AmqpConfig = d.config()
		cfg.ReconnectBackoff = func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) }
	})
	const n = 200
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("%s-%03d", e.prefix, i), []byte(fmt.Sprintf(`{"n":%d}`, i)))
	}
	e.publish(msgs...)
	// offered: has the consumer offered all n records to the (down) store
	// since the last reset? Then its session holds every one of them.
	offered := func() bool { return len(store.offered()) == n }
	testkit.WaitFor(t, 10*time.Second, "the consumer to hold every arrival", offered)
	done := 0
	for range closes {
		store.reset()
		if d.drop() == 0 {
			t.Fatal("no connection to drop")
		}
		// Every held record is delivered again, unless a delivery limit
		// dropped it (then the loop stops and the account shows it).
		deadline := time.Now().Add(10 * time.Second)
		for !offered() && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond) // polling; the deadline decides
		}
		done++
		if !offered() {
			t.Logf("after %d connection losses only %d of %d records were delivered again", done, len(store.offered()), n)
			break
		}
	}
	store.SetDown(false)
	stored := func() int { a, _, _, _, _ := store.Counts(); return a }
	deadline := time.Now().Add(20 * time.Second)
	for stored() < n && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond) // polling the store; not synchronisation
	}
	got := stored()
	setAside := e.ready(e.naming.WithDefaults().SetAsideQueue)
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d (connection closes=%d)",
		t.Name(), n, got, setAside, 0, n-got-setAside, done)
	if got != n {
		t.Fatalf("%d of %d records stored after %d connection losses (set aside %d)", got, n, done, setAside)
	}
}
