package admin_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	amqp "github.com/rabbitmq/amqp091-go"
)

const loopBack = "rabbitretry.loopback"

// fixture is the topology of one test, built with plain amqp091-go:
//
//	rabbitretry.loopback --(Q)--> Q
//	business (direct)    --(Q)--> Q, Q2
//	default exchange     -------> Q.poison
type fixture struct {
	uri      string
	conn     *amqp.Connection
	ch       *amqp.Channel // confirm mode
	Q, Q2    string
	Poison   string
	Business string
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	uri := brokerURI(t)
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{uri: uri, conn: conn}
	f.Q = uniqueName(t, "admintest")
	f.Q2 = f.Q + ".other"
	f.Poison = f.Q + ".poison"
	f.Business = f.Q + ".business"
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			for _, q := range []string{f.Q, f.Q2, f.Poison} {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
			_ = ch.ExchangeDelete(f.Business, false, false)
			_ = ch.Close()
		}
		_ = conn.Close()
	})
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(ch.ExchangeDeclare(loopBack, amqp.ExchangeDirect, true, false, false, false, nil))
	must(ch.ExchangeDeclare(f.Business, amqp.ExchangeDirect, true, false, false, false, nil))
	for _, q := range []string{f.Q, f.Q2, f.Poison} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		must(err)
	}
	must(ch.QueueBind(f.Q, f.Q, loopBack, false, nil))
	must(ch.QueueBind(f.Q, f.Q, f.Business, false, nil))
	must(ch.QueueBind(f.Q2, f.Q, f.Business, false, nil))
	must(ch.Confirm(false))
	f.ch = ch
	return f
}

// poisonHeaders returns the headers middleware.PoisonForwarder writes for message i.
func (f *fixture) poisonHeaders(i int, uuid, class string, at time.Time) amqp.Table {
	return amqp.Table{
		"_watermill_message_uuid":          uuid,
		"reason_poisoned":                  fmt.Sprintf("handler failed: message %d is bad", i),
		"topic_poisoned":                   f.Q,
		"handler_poisoned":                 "orders-handler",
		"subscriber_poisoned":              "amqp-subscriber",
		"rabbitretry-attempts":             "5",
		"rabbitretry-poisoned-at":          at.UTC().Format(time.RFC3339Nano),
		"rabbitretry-original-queue":       f.Q,
		"rabbitretry-original-exchange":    f.Business,
		"rabbitretry-original-routing-key": f.Q,
		"rabbitretry-error-class":          class,
		"rabbitretry-first-failure":        at.Add(-time.Minute).UTC().Format(time.RFC3339Nano),
		"rabbitretry-last-failure":         at.UTC().Format(time.RFC3339Nano),
		"rabbitretry-last-error":           fmt.Sprintf("handler failed: message %d is bad", i),
		"rabbitretry-attempt":              "5",
	}
}

// publish publishes msgs to queue via the default exchange and waits for
// every confirm.
func (f *fixture) publish(t *testing.T, queue string, msgs []amqp.Publishing) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	confs := make([]*amqp.DeferredConfirmation, 0, len(msgs))
	for _, m := range msgs {
		dc, err := f.ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, m)
		if err != nil {
			t.Fatal(err)
		}
		confs = append(confs, dc)
	}
	for _, dc := range confs {
		ok, err := dc.WaitContext(ctx)
		if err != nil || !ok {
			t.Fatalf("publish not confirmed: ok=%v err=%v", ok, err)
		}
	}
}

// publishPoisoned writes n poisoned messages to the poison queue; classes
// cycles through the given classes. It returns the UUIDs in order.
func (f *fixture) publishPoisoned(t *testing.T, n int, classes ...string) []string {
	t.Helper()
	if len(classes) == 0 {
		classes = []string{"permanent"}
	}
	base := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	uuids := make([]string, n)
	msgs := make([]amqp.Publishing, n)
	for i := range n {
		uuids[i] = fmt.Sprintf("uuid-%04d-%s", i, f.Q[len(f.Q)-12:])
		msgs[i] = amqp.Publishing{
			Headers:      f.poisonHeaders(i, uuids[i], classes[i%len(classes)], base.Add(time.Duration(i)*time.Second)),
			ContentType:  "application/json",
			DeliveryMode: amqp.Persistent,
			Body:         []byte(`{"n":` + strconv.Itoa(i) + `}`),
		}
	}
	f.publish(t, f.Poison, msgs)
	return uuids
}

// depth returns the ready message count of queue.
func (f *fixture) depth(t *testing.T, queue string) int {
	t.Helper()
	ch, err := f.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// drain removes and returns every message of queue.
func (f *fixture) drain(t *testing.T, queue string) []amqp.Delivery {
	t.Helper()
	ch, err := f.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

func uuidOf(d amqp.Delivery) string {
	s, _ := d.Headers["_watermill_message_uuid"].(string)
	return s
}

func brokerURI(t testing.TB) string { return testkit.URI(t) }

func uniqueName(t testing.TB, prefix string) string { return testkit.UniqueName(t, prefix) }
