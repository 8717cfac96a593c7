package audit_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// The whole path: messages published to a business exchange are recorded
// by the audit Consumer into PostgreSQL; Resend rebuilds them from those
// arrival records. The resent copy must equal the original delivery: body
// byte-exact, every property (but user-id), every header with its value
// and AMQP type (int32 stays int32, a timestamp a timestamp, a byte array
// a byte array), plus rabbitretry-resent.
func TestResendEndToEndFromTheAuditConsumer(t *testing.T) {
	uri := testkit.URI(t)
	st, _ := pgStore(t)
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	ex, lb, q := testkit.UniqueName(t, "orders"), testkit.UniqueName(t, "lb"), testkit.UniqueName(t, "billing")
	naming := audit.Naming{Exchange: testkit.UniqueName(t, "audit"), AttemptsQueue: testkit.UniqueName(t, "audit.att"), ArrivalsQueue: testkit.UniqueName(t, "audit.arr")}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(ch.ExchangeDeclare(ex, "topic", false, false, false, false, nil))
	must(ch.ExchangeDeclare(lb, "direct", false, false, false, false, nil))
	_, err = ch.QueueDeclare(q, false, false, false, false, nil)
	must(err)
	must(ch.QueueBind(q, "order.#", ex, false, nil))
	must(ch.QueueBind(q, q, lb, false, nil))
	t.Cleanup(func() {
		c, err := conn.Channel()
		if err != nil {
			return
		}
		for _, name := range []string{q, naming.AttemptsQueue, naming.ArrivalsQueue} {
			_, _ = c.QueueDelete(name, false, false, false)
		}
		for _, name := range []string{ex, lb, naming.Exchange} {
			_ = c.ExchangeDelete(name, false, false)
		}
	})

	cons, err := audit.NewConsumer(audit.ConsumerConfig{URI: uri, Store: st, Exchanges: []audit.Binding{{Exchange: ex}},
		QueueType: audit.QueueTypeClassic, Naming: naming, BatchWait: 20 * time.Millisecond})
	must(err)
	must(cons.Declare())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cons.Run(ctx) }()
	defer func() { cancel(); <-done }()

	published := time.Date(2026, 11, 24, 8, 30, 15, 0, time.UTC)
	const n = 6
	for i := range n {
		tenant := "globex"
		if i%2 == 0 {
			tenant = "acme"
		}
		must(ch.PublishWithContext(context.Background(), ex, "order.created", false, false, amqp.Publishing{
			Headers: amqp.Table{
				"_watermill_message_uuid": fmt.Sprintf("e2e-%d", i), "tenant": tenant,
				"i32": int32(-7), "i64": int64(1) << 40, "f64": 2.5, "yes": true,
				"table": amqp.Table{"k": "v", "n": int64(1)}, "list": []any{"a", int64(2)},
				"when": published, "raw": []byte{0, 1, 0xfe},
				"rabbitretry-attempt": int64(4), // retry state: must not travel
			},
			ContentType: "application/json", ContentEncoding: "identity", DeliveryMode: 2, Priority: 4,
			CorrelationId: fmt.Sprintf("corr-%d", i), ReplyTo: "replies", Type: "order.created", AppId: "shop",
			Timestamp: published, Body: []byte(fmt.Sprintf(`{"order":%d,"bin":"\u0000"}`, i)),
		}))
	}
	originals := map[string]amqp.Delivery{}
	testkit.WaitFor(t, 10*time.Second, "the originals in "+q, func() bool {
		for {
			d, ok, err := ch.Get(q, true)
			must(err)
			if !ok {
				return len(originals) == n
			}
			originals[d.Headers["_watermill_message_uuid"].(string)] = d
		}
	})
	testkit.WaitFor(t, 15*time.Second, "the audit Consumer to record the arrivals", func() bool {
		msgs, err := st.Search(context.Background(), audit.Filter{Exchange: ex})
		return err == nil && len(msgs) == n
	})

	r := newTestResender(t, st, &resendTopology{loopBack: lb})
	rep, err := r.Resend(context.Background(), audit.Filter{Exchange: ex, Headers: map[string]any{"tenant": "acme"}},
		audit.ResendOptions{Mode: audit.ResendToQueue, Queue: q})
	if err != nil || rep.Matched != 3 || rep.Sent != 3 {
		t.Fatalf("resend: %+v %v", rep, err)
	}
	var resent []amqp.Delivery
	testkit.WaitFor(t, 10*time.Second, "3 resent copies", func() bool {
		for {
			d, ok, err := ch.Get(q, true)
			must(err)
			if !ok {
				return len(resent) >= 3
			}
			resent = append(resent, d)
		}
	})
	if len(resent) != 3 {
		t.Fatalf("%d copies", len(resent))
	}
	for _, d := range resent {
		id, _ := d.Headers["_watermill_message_uuid"].(string)
		o, ok := originals[id]
		if !ok || o.Headers["tenant"] != "acme" {
			t.Fatalf("resent %q: not one of the acme originals", id)
		}
		if string(d.Body) != string(o.Body) {
			t.Errorf("%s body %q, want %q", id, d.Body, o.Body)
		}
		type props struct {
			ContentType, ContentEncoding, CorrelationId, ReplyTo, Type, AppId, MessageId string
			DeliveryMode, Priority                                                       uint8
			Timestamp                                                                    time.Time
		}
		pd := props{d.ContentType, d.ContentEncoding, d.CorrelationId, d.ReplyTo, d.Type, d.AppId, d.MessageId, d.DeliveryMode, d.Priority, d.Timestamp}
		po := props{o.ContentType, o.ContentEncoding, o.CorrelationId, o.ReplyTo, o.Type, o.AppId, o.MessageId, o.DeliveryMode, o.Priority, o.Timestamp}
		if pd != po {
			t.Errorf("%s properties\n got %+v\nwant %+v", id, pd, po)
		}
		want := amqp.Table{
			"_watermill_message_uuid": id, "tenant": "acme",
			"i32": int32(-7), "i64": int64(1) << 40, "f64": 2.5, "yes": true,
			"table": amqp.Table{"k": "v", "n": int64(1)}, "list": []any{"a", int64(2)},
			"when": published, "raw": []byte{0, 1, 0xfe},
			// to-queue: the true origin for the retry chain's failure history
			"rabbitretry-original-exchange": ex, "rabbitretry-original-routing-key": "order.created",
		}
		got := amqp.Table{}
		for k, v := range d.Headers {
			switch k {
			case auditconst.ResentKey:
				if s, _ := v.(string); s == "" {
					t.Errorf("%s: %s = %#v", id, k, v)
				}
			case confirm.PublishIDHeader: // the confirm.Publisher's, the only addition
			default:
				got[k] = normal(v)
			}
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s headers\n got %#v\nwant %#v", id, got, want)
		}
	}

	// To the exchange: the queue gets it again, and so does the audit's
	// arrivals queue: the resend is recorded as a new arrival.
	rep, err = r.Resend(context.Background(), audit.Filter{MessageID: "e2e-1"}, audit.ResendOptions{Mode: audit.ResendToExchange})
	if err != nil || rep.Sent != 1 {
		t.Fatalf("to exchange: %+v %v", rep, err)
	}
	testkit.WaitFor(t, 15*time.Second, "the resent copy recorded as a 7th arrival", func() bool {
		s, err := st.Stats(context.Background())
		return err == nil && s.Arrivals == n+1
	})
	t.Logf("accounting: published %d, recorded %d, resent to-queue 3 (acme) identical to the originals, 1 to-exchange recorded again", n, n)
}
