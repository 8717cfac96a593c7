package amqpretry

import (
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	amqp "github.com/rabbitmq/amqp091-go"
)

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

// waitFor polls cond until it returns true, failing with msg after timeout.
func waitFor(t testing.TB, timeout time.Duration, msg string, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, timeout, msg, cond)
}

func brokerURI(t testing.TB) string { return testkit.URI(t) }

func uniqueName(t testing.TB, prefix string) string { return testkit.UniqueName(t, prefix) }

var xdeathTestTime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

// brokerXDeathEntry returns an x-death entry shaped as amqp091-go decodes it
// from RabbitMQ: count int64, time time.Time (local zone), routing-keys
// []interface{} of string.
func brokerXDeathEntry(queue, reason string, count interface{}) amqp.Table {
	return amqp.Table{
		"queue":        queue,
		"reason":       reason,
		"count":        count,
		"exchange":     "orders",
		"routing-keys": []interface{}{"order.created"},
		"time":         xdeathTestTime.Local(),
	}
}
