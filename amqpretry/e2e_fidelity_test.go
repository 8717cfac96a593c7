package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/poison/admin"
)

// everyTypeHeaders returns user headers of every AMQP 0-9-1 field type that
// amqp091-go encodes (t b B s u I i l f d D S x T F A V), nested ones
// included, as a Java, Node or .NET producer may send them.
func everyTypeHeaders() amqp.Table {
	return amqp.Table{
		"h-bool-true":  true,
		"h-bool-false": false,
		"h-int8":       int8(-8),
		"h-uint8":      uint8(200),
		"h-int16":      int16(-1600),
		"h-uint16":     uint16(60000),
		"h-int32":      int32(-320000),
		"h-uint32":     uint32(4000000000),
		"h-int64":      int64(-1) << 40,
		"h-float32":    float32(1.5),
		"h-float64":    float64(-2.25),
		"h-decimal":    amqp.Decimal{Scale: 2, Value: -12345},
		"h-timestamp":  time.Date(2024, 2, 29, 12, 30, 45, 0, time.UTC),
		"h-bytes":      []byte("raw\x00\xffbytes"),
		"h-bytes-nil":  []byte{},
		"h-string":     "plain",
		"h-void":       nil,
		"h-table": amqp.Table{
			"s": "v", "n": int32(1), "l": int64(7), "b": false, "f": float32(0.25),
			"nested": amqp.Table{"deeper": []any{int16(3), "x"}, "ts": time.Unix(1700000000, 0)},
			"void":   nil, "bytes": []byte{1, 2, 3}, "dec": amqp.Decimal{Scale: 0, Value: 9},
		},
		"h-table-empty": amqp.Table{},
		"h-array":       []any{"a", int32(1), true, []any{"x", uint8(1)}, amqp.Table{"k": int64(2)}, nil, float64(3.5)},
		"h-array-empty": []any{},
		"x-custom-int":  int32(42), // an x- header that is not the broker's
	}
}

// userHeaders returns h without the keys the library writes itself (the
// rabbitretry-* failure metadata, Watermill's *_poisoned keys and UUID
// header) and without broker headers (x-death, x-first-death-*, ...).
func userHeaders(h amqp.Table) amqp.Table {
	out := amqp.Table{}
	for k, v := range h {
		switch {
		case strings.HasPrefix(k, "rabbitretry-"), strings.HasSuffix(k, "_poisoned"),
			k == wamqp.DefaultMessageUUIDHeaderKey, k == "x-death", k == "x-delivery-count",
			strings.HasPrefix(k, "x-first-death-"), strings.HasPrefix(k, "x-last-death-"):
			continue
		}
		out[k] = v
	}
	return out
}

// diffTables describes, key by key, where got differs from want (value or
// Go type), or "" if they are reflect.DeepEqual.
func diffTables(want, got amqp.Table) string {
	if reflect.DeepEqual(want, got) {
		return ""
	}
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(want)) {
		g, ok := got[k]
		switch {
		case !ok:
			fmt.Fprintf(&b, "\n  %s: missing (want %T %#v)", k, want[k], want[k])
		case !reflect.DeepEqual(want[k], g):
			fmt.Fprintf(&b, "\n  %s: got %T %#v, want %T %#v", k, g, g, want[k], want[k])
		}
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[k]; !ok {
			fmt.Fprintf(&b, "\n  %s: unexpected %T %#v", k, got[k], got[k])
		}
	}
	return b.String()
}

// tapQueue declares a queue bound to the business exchange with the routing
// key the services use, so the test sees each publish as the broker delivers
// it to the services. Declare it after start (the subscriber declares the
// exchange).
func (e *testEnv) tapQueue() string {
	e.t.Helper()
	q := e.prefix + ".tap"
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(q, false, false, false, false, nil); err != nil {
		e.t.Fatal(err)
	}
	if err := ch.QueueBind(q, "order.created", e.exchange, false, nil); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		if ch, err := e.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(q, false, false, false)
			_ = ch.Close()
		}
	})
	return q
}

// getOne waits for one message in q and returns it (acked).
func (e *testEnv) getOne(q string) amqp.Delivery {
	e.t.Helper()
	var got []amqp.Delivery
	waitFor(e.t, 10*time.Second, "a message in "+q, func() bool {
		got = append(got, e.drain(q)...)
		return len(got) > 0
	})
	if len(got) != 1 {
		e.t.Fatalf("%d messages in %s, want 1", len(got), q)
	}
	return got[0]
}

// publishRaw publishes p to the business exchange with the services' key.
func (e *testEnv) publishRaw(ps ...amqp.Publishing) {
	e.t.Helper()
	for _, p := range ps {
		if err := e.ch.PublishWithContext(context.Background(), e.exchange, "order.created", false, false, p); err != nil {
			e.t.Fatal(err)
		}
	}
}

// Item 11: a message whose headers have every AMQP type goes through a real
// retry (copy to the wait queue, dead-lettered back to Q by the broker) and is
// then poisoned; the poison copy's user headers are reflect.DeepEqual to the
// headers of the original as the broker delivered it: same values, same Go
// (AMQP) types, nested ones included. The handler sees the same readable
// strings on both attempts.
func TestE2E_HeaderTypesSurviveRetryAndPoison(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt)
		var mu sync.Mutex
		var metas []message.Metadata
		q := e.handle("svc", func(msg *message.Message) error {
			mu.Lock()
			metas = append(metas, maps.Clone(msg.Metadata))
			mu.Unlock()
			if middleware.Attempt(msg) == 1 {
				return errTransient
			}
			return middleware.Permanent(errors.New("give up"))
		})
		e.start()
		tap := e.tapQueue()
		uuid := watermill.NewUUID()
		h := everyTypeHeaders()
		h[wamqp.DefaultMessageUUIDHeaderKey] = uuid
		e.publishRaw(amqp.Publishing{Headers: h, Body: []byte("typed"), DeliveryMode: amqp.Persistent})

		orig := e.getOne(tap)
		pq := e.retry.Topology().Naming().PoisonQueue(q)
		waitFor(t, 15*time.Second, "the poison copy", func() bool { return e.depth(pq) == 1 })
		e.stopRouter()
		p := e.getOne(pq)

		want := userHeaders(orig.Headers)
		if len(want) != len(everyTypeHeaders()) {
			t.Fatalf("the tap got %d user headers, want %d: %v", len(want), len(everyTypeHeaders()), want)
		}
		if d := diffTables(want, userHeaders(p.Headers)); d != "" {
			t.Errorf("poison copy headers differ from the original's:%s", d)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(metas) != 2 {
			t.Fatalf("%d attempts, want 2", len(metas))
		}
		for k := range everyTypeHeaders() {
			if metas[0][k] != metas[1][k] {
				t.Errorf("%s: handler saw %q on attempt 1, %q on attempt 2", k, metas[0][k], metas[1][k])
			}
		}
		if metas[0]["h-int32"] != "-320000" || metas[0]["h-bool-true"] != "true" || metas[0]["h-bytes"] != "raw\x00\xffbytes" {
			t.Errorf("handler does not see readable strings: %q %q %q", metas[0]["h-int32"], metas[0]["h-bool-true"], metas[0]["h-bytes"])
		}
	})
}

// Item 11, without the router: a delivery read from a real queue, run through
// Unmarshal and Marshal and published again, arrives with headers
// reflect.DeepEqual to the first delivery's. A value the handler changed goes
// out as the handler's string; a header it deleted is gone.
func TestE2E_MarshalerKeepsHeaderTypes(t *testing.T) {
	conn, err := amqp.Dial(e2eURI(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	get := func() amqp.Delivery {
		t.Helper()
		var d amqp.Delivery
		waitFor(t, 5*time.Second, "a message", func() bool {
			var ok bool
			d, ok, err = ch.Get(q.Name, true)
			if err != nil {
				t.Fatal(err)
			}
			return ok
		})
		return d
	}
	h := everyTypeHeaders()
	h[wamqp.DefaultMessageUUIDHeaderKey] = "u-1"
	if err := ch.PublishWithContext(context.Background(), "", q.Name, false, false, amqp.Publishing{Headers: h, Body: []byte("b")}); err != nil {
		t.Fatal(err)
	}
	d1 := get()
	m := amqpretry.Marshaler{}
	msg, err := m.Unmarshal(d1)
	if err != nil {
		t.Fatal(err)
	}
	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.PublishWithContext(context.Background(), "", q.Name, false, false, p); err != nil {
		t.Fatal(err)
	}
	d2 := get()
	if d := diffTables(userHeaders(d1.Headers), userHeaders(d2.Headers)); d != "" {
		t.Errorf("Unmarshal→Marshal changed the headers:%s", d)
	}
	if d2.Headers[wamqp.DefaultMessageUUIDHeaderKey] != "u-1" {
		t.Errorf("UUID header %#v", d2.Headers[wamqp.DefaultMessageUUIDHeaderKey])
	}

	// The handler changes one typed value and deletes another.
	msg2, err := m.Unmarshal(d2)
	if err != nil {
		t.Fatal(err)
	}
	msg2.Metadata.Set("h-int32", "changed by the handler")
	delete(msg2.Metadata, "h-table")
	p3, err := m.Marshal(msg2)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.PublishWithContext(context.Background(), "", q.Name, false, false, p3); err != nil {
		t.Fatal(err)
	}
	d3 := get()
	want := userHeaders(d1.Headers)
	want["h-int32"] = "changed by the handler"
	delete(want, "h-table")
	if d := diffTables(want, userHeaders(d3.Headers)); d != "" {
		t.Errorf("after the handler's changes:%s", d)
	}
}

// Item 11: a transient message (delivery mode 1) stays transient on the retry
// copy and the poison copy; a message with neither a UUID header nor a
// message-id gets a generated UUID on its first delivery, which the retry
// copy and the poison copy carry, and two such messages get different ones.
func TestE2E_DeliveryModeAndIdentityKept(t *testing.T) {
	e := newEnv(t, "classic")
	var mu sync.Mutex
	seen := map[string][]string{} // payload -> UUID per attempt
	q := e.handle("svc", func(msg *message.Message) error {
		mu.Lock()
		seen[string(msg.Payload)] = append(seen[string(msg.Payload)], msg.UUID)
		mu.Unlock()
		if middleware.Attempt(msg) == 1 {
			return errTransient
		}
		return middleware.Permanent(errors.New("give up"))
	})
	e.start()
	e.publishRaw(
		amqp.Publishing{Body: []byte("transient-anon-1"), DeliveryMode: amqp.Transient},
		amqp.Publishing{Body: []byte("transient-anon-2"), DeliveryMode: amqp.Transient},
		amqp.Publishing{Body: []byte("persistent-anon"), DeliveryMode: amqp.Persistent},
	)
	pq := e.retry.Topology().Naming().PoisonQueue(q)
	waitFor(t, 15*time.Second, "3 poison copies", func() bool { return e.depth(pq) == 3 })
	e.stopRouter()
	ds := e.drain(pq)
	mu.Lock()
	defer mu.Unlock()
	uuids := map[string]string{}
	for _, d := range ds {
		body := string(d.Body)
		wantMode := uint8(amqp.Transient)
		if strings.HasPrefix(body, "persistent") {
			wantMode = amqp.Persistent
		}
		if d.DeliveryMode != wantMode {
			t.Errorf("%s: poison copy delivery mode %d, want %d", body, d.DeliveryMode, wantMode)
		}
		u, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		s := seen[body]
		if len(s) != 2 || s[0] == "" || s[0] != s[1] || u != s[0] {
			t.Errorf("%s: UUIDs per attempt %q, poison copy %q: want one non-empty UUID throughout", body, s, u)
		}
		if d.MessageId != "" {
			t.Errorf("%s: the poison copy got a message-id property %q", body, d.MessageId)
		}
		if other, dup := uuids[u]; dup {
			t.Errorf("%s and %s share the UUID %q", body, other, u)
		}
		uuids[u] = body
	}
}

// Item 10: a producer that forges rabbitretry-original-queue (pointing at
// another library-managed queue), -exchange and -routing-key on a message
// published to the business exchange cannot redirect its replay: the poison
// copy names the queue it was consumed from, the business exchange and the
// routing key it was published with, and admin.Replay delivers it back to
// that queue only. With DeadLetterFirstRetry (quorum) the first retry is a
// nack of the original (no copy written by the library), which must not let
// the forged keys through either; there the first copy the library writes
// is made from a delivery that came back through the default exchange, so
// the origin exchange and routing key it records are that delivery's ("" and
// the queue name), not the business exchange's (as before this fix).
func TestE2E_ForgedOriginIgnored(t *testing.T) {
	for _, tc := range []struct {
		name          string
		qt            string
		opts          []envOption
		viaDeadLetter bool
	}{
		{"classic", amqpretry.QueueTypeClassic, nil, false},
		{"quorum-dead-letter-first", amqpretry.QueueTypeQuorum, []envOption{func(c *amqpretry.Config) { c.Mode = amqpretry.DeadLetterFirst() }}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.qt, tc.opts...)
			var fixed atomic.Bool
			inbox := newRecorder()
			other := newRecorder()
			qInbox := e.handle("inbox", func(msg *message.Message) error {
				inbox.record(msg, middleware.Attempt(msg))
				if !fixed.Load() {
					return errTransient
				}
				return nil
			})
			qOther := e.handle("other", func(msg *message.Message) error {
				other.record(msg, middleware.Attempt(msg))
				return nil
			})
			e.start()
			msg := message.NewMessage(watermill.NewUUID(), []byte("forged"))
			msg.Metadata.Set(middleware.OriginalQueueKey, qOther)
			msg.Metadata.Set(middleware.OriginalExchangeKey, "forged-exchange")
			msg.Metadata.Set(middleware.OriginalRoutingKeyKey, "forged.key")
			e.publish(msg)

			pq := e.retry.Topology().Naming().PoisonQueue(qInbox)
			waitFor(t, 20*time.Second, "the poison copy", func() bool { return e.depth(pq) == 1 })
			if n := inbox.count(msg.UUID); n != 3 {
				t.Errorf("inbox handled the message %d times before poisoning, want 3 (MaxAttempts)", n)
			}
			a, err := admin.New(admin.Config{URI: e.uri})
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			list, err := a.List(context.Background(), pq, admin.Filter{})
			if err != nil || len(list) != 1 {
				t.Fatalf("list: %v %v", list, err)
			}
			m := list[0]
			wantEx, wantKey := e.exchange, "order.created"
			if tc.viaDeadLetter {
				wantEx, wantKey = "", qInbox
			}
			if m.OriginalQueue != qInbox || m.OriginalExchange != wantEx || m.OriginalRoutingKey != wantKey {
				t.Errorf("poison copy origin queue %q exchange %q routing key %q, want %q %q %q",
					m.OriginalQueue, m.OriginalExchange, m.OriginalRoutingKey, qInbox, wantEx, wantKey)
			}
			fixed.Store(true)
			res, err := a.Replay(context.Background(), pq, admin.Filter{}, admin.ReplayOptions{})
			if err != nil || res.Replayed != 1 {
				t.Fatalf("replay: %+v %v", res, err)
			}
			waitFor(t, 10*time.Second, "the replayed message in inbox", func() bool { return inbox.count(msg.UUID) == 4 })
			e.waitQueuesEmpty(qInbox, 5*time.Second)
			e.stopRouter()
			if n := other.count(msg.UUID); n != 1 {
				t.Errorf("the other queue %s handled the message %d times, want 1 (its own copy from the exchange, never the replay)", qOther, n)
			}
			if d := e.depth(qOther) + e.depth(qInbox) + e.depth(pq); d != 0 {
				t.Errorf("%d messages left", d)
			}
			// What the handler saw on attempts 3 and 4 (a copy the library
			// published, then the replay): the library's origin keys, never the
			// forged ones. (With DeadLetterFirstRetry attempt 2 is the original
			// itself, dead-lettered by the broker, so it still shows them.)
			inbox.mu.Lock()
			defer inbox.mu.Unlock()
			for i, md := range inbox.meta[msg.UUID] {
				for k, forged := range map[string]string{middleware.OriginalQueueKey: qOther, middleware.OriginalExchangeKey: "forged-exchange", middleware.OriginalRoutingKeyKey: "forged.key"} {
					if i >= 2 && md.Get(k) == forged {
						t.Errorf("inbox attempt %d still carries the forged %s = %q", i+1, k, forged)
					}
				}
			}
		})
	}
}
