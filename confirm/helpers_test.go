package confirm

import (
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	amqp "github.com/rabbitmq/amqp091-go"
)

const defaultTestAMQPURI = testkit.DefaultURI

// declareTempQueue declares a non-durable queue named name with args on ch
// and deletes it in t.Cleanup (over a fresh connection, because ch may be
// closed by then).
func declareTempQueue(t testing.TB, ch *amqp.Channel, name string, args amqp.Table) {
	t.Helper()
	if _, err := ch.QueueDeclare(name, false, false, false, false, args); err != nil {
		t.Fatalf("declaring queue %q: %v", name, err)
	}
	uri := brokerURI(t)
	t.Cleanup(func() {
		conn, err := amqp.Dial(uri)
		if err != nil {
			t.Errorf("cleanup: dialling to delete queue %q: %v", name, err)
			return
		}
		defer conn.Close()
		c, err := conn.Channel()
		if err != nil {
			t.Errorf("cleanup: channel to delete queue %q: %v", name, err)
			return
		}
		if _, err := c.QueueDelete(name, false, false, false); err != nil {
			t.Errorf("cleanup: deleting queue %q: %v", name, err)
		}
	})
}

// testChannel opens a plain channel on its own connection, closed in Cleanup.
func testChannel(t testing.TB) *amqp.Channel {
	t.Helper()
	conn, err := amqp.Dial(brokerURI(t))
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	return ch
}

// queueDepth returns the number of ready messages in queue, using a fresh
// channel each time (a passive declare of a missing queue closes the channel).
func queueDepth(t testing.TB, conn *amqp.Connection, queue string) int {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		t.Fatalf("passive declare of %q: %v", queue, err)
	}
	return q.Messages
}

// waitFor polls cond until it returns true, failing with msg after timeout.
func waitFor(t testing.TB, timeout time.Duration, msg string, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, timeout, msg, cond)
}

// newTestPublisher creates a Publisher against the test broker and
// closes it in Cleanup.
func newTestPublisher(t testing.TB, cfg Config) *Publisher {
	t.Helper()
	if cfg.URI == "" && cfg.Dial == nil {
		cfg.URI = brokerURI(t)
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatalf("NewPublisher: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p
}

func brokerURI(t testing.TB) string { return testkit.URI(t) }

func uniqueName(t testing.TB, prefix string) string { return testkit.UniqueName(t, prefix) }
