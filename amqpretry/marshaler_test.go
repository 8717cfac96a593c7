package amqpretry

import (
	"context"
	"maps"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// deliveryFromPublishing returns the delivery a consumer would get for p.
func deliveryFromPublishing(p amqp.Publishing, exchange, key string) amqp.Delivery {
	return amqp.Delivery{
		Headers: p.Headers, ContentType: p.ContentType, DeliveryMode: p.DeliveryMode,
		MessageId: p.MessageId, Body: p.Body, Exchange: exchange, RoutingKey: key,
	}
}

// deepCopyTable copies t and, one level down, the arrays and tables in it,
// so that a later comparison detects mutation of nested values too.
func deepCopyTable(t amqp.Table) amqp.Table {
	c := make(amqp.Table, len(t))
	for k, v := range t {
		switch x := v.(type) {
		case []interface{}:
			a := make([]interface{}, len(x))
			for i, e := range x {
				if et, ok := e.(amqp.Table); ok {
					a[i] = maps.Clone(et)
				} else {
					a[i] = e
				}
			}
			c[k] = a
		default:
			c[k] = v
		}
	}
	return c
}

func brokerDelivery() amqp.Delivery {
	return amqp.Delivery{
		Exchange:   "",
		RoutingKey: "B",
		Body:       []byte("payload"),
		Headers: amqp.Table{
			wamqp.DefaultMessageUUIDHeaderKey: "uuid-1",
			"user-key":                        "user-value",
			"x-death": []interface{}{
				brokerXDeathEntry("A", "rejected", int64(1)),
			},
			"x-first-death-queue":    "A",
			"x-first-death-reason":   "rejected",
			"x-first-death-exchange": "orders",
			"x-last-death-queue":     "A",
			"x-delivery-count":       int64(2),
			"num":                    int32(5),
			"flag":                   true,
			"ts":                     xdeathTestTime,
			confirm.PublishIDHeader:  "abc-0-1",
		},
	}
}

func TestMarshalerUnmarshalBrokerHeaders(t *testing.T) {
	d := brokerDelivery()
	before := deepCopyTable(d.Headers)

	if _, err := (wamqp.DefaultMarshaler{}).Unmarshal(d); err == nil {
		t.Fatal("wamqp.DefaultMarshaler unexpectedly accepted non-string headers; the wrapper would be unnecessary")
	}

	msg, err := Marshaler{}.Unmarshal(d)
	if err != nil {
		t.Fatalf("Unmarshal: %v", err)
	}
	if !reflect.DeepEqual(d.Headers, before) {
		t.Fatalf("Unmarshal mutated the delivery headers:\n got  %#v\n want %#v", d.Headers, before)
	}
	if msg.UUID != "uuid-1" || string(msg.Payload) != "payload" {
		t.Fatalf("UUID %q payload %q", msg.UUID, msg.Payload)
	}
	recs, err := amqpwire.ParseXDeath(msg.Metadata.Get(middleware.XDeathKey))
	if err != nil {
		t.Fatalf("ParseXDeath: %v", err)
	}
	want := []amqpwire.DeathRecord{{Queue: "A", Reason: "rejected", Count: 1, Exchange: "orders",
		RoutingKeys: []string{"order.created"}, Time: xdeathTestTime}}
	if !reflect.DeepEqual(recs, want) {
		t.Fatalf("x-death records %#v, want %#v", recs, want)
	}
	for k, v := range map[string]string{
		"user-key":                      "user-value",
		"x-first-death-queue":           "A",
		"x-first-death-reason":          "rejected",
		"x-first-death-exchange":        "orders",
		"x-last-death-queue":            "A",
		retrymeta.XDeliveryCountKey:     "2",
		"num":                           "5",
		"flag":                          "true",
		"ts":                            "2024-05-06T07:08:09Z",
		retrymeta.DeliveryExchangeKey:   "",
		retrymeta.DeliveryRoutingKeyKey: "B",
	} {
		got, ok := msg.Metadata[k]
		if !ok || got != v {
			t.Errorf("metadata %q = %q (present %v), want %q", k, got, ok, v)
		}
	}
	for _, k := range []string{confirm.PublishIDHeader, retrymeta.HeaderErrorKey, wamqp.DefaultMessageUUIDHeaderKey} {
		if v, ok := msg.Metadata[k]; ok {
			t.Errorf("metadata %q = %q should be absent", k, v)
		}
	}
}

func TestMarshalerUnmarshalMalformedBrokerHeaders(t *testing.T) {
	cases := map[string]struct {
		headers  amqp.Table
		wantErrs []string
		absent   []string
	}{
		"forged string x-death": {
			headers:  amqp.Table{"x-death": `[{"queue":"A","count":1}]`},
			wantErrs: []string{"x-death"},
			absent:   []string{middleware.XDeathKey},
		},
		"negative counts": {
			headers: amqp.Table{
				"x-death":          []interface{}{brokerXDeathEntry("A", "rejected", int64(-1))},
				"x-delivery-count": int64(-1),
			},
			wantErrs: []string{"x-death: x-death entry 0: count -1 is negative", "x-delivery-count -1 is negative"},
			absent:   []string{middleware.XDeathKey, retrymeta.XDeliveryCountKey},
		},
		"huge count and missing queue": {
			headers: amqp.Table{"x-death": []interface{}{
				brokerXDeathEntry("A", "rejected", int64(1)),
				amqp.Table{"reason": "expired", "count": int64(math.MaxInt64)},
			}},
			wantErrs: []string{"entry 1: missing queue"},
			absent:   []string{middleware.XDeathKey},
		},
		"unsupported Go value": {
			headers:  amqp.Table{"weird": struct{}{}},
			wantErrs: []string{`header "weird"`},
			absent:   []string{"weird"},
		},
		"stale header error is replaced": {
			headers:  amqp.Table{retrymeta.HeaderErrorKey: "old", "x-delivery-count": "x"},
			wantErrs: []string{"x-delivery-count"},
		},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			tc.headers[wamqp.DefaultMessageUUIDHeaderKey] = "u"
			tc.headers["keep"] = "me"
			msg, err := Marshaler{}.Unmarshal(amqp.Delivery{Headers: tc.headers, Body: []byte("b")})
			if err != nil {
				t.Fatalf("Unmarshal must not fail because of broker headers: %v", err)
			}
			he := msg.Metadata.Get(retrymeta.HeaderErrorKey)
			for _, w := range tc.wantErrs {
				if !strings.Contains(he, w) {
					t.Errorf("%s = %q, want it to contain %q", retrymeta.HeaderErrorKey, he, w)
				}
			}
			if strings.Contains(he, "old") {
				t.Errorf("stale %s survived: %q", retrymeta.HeaderErrorKey, he)
			}
			for _, k := range tc.absent {
				if v, ok := msg.Metadata[k]; ok {
					t.Errorf("metadata %q = %q should have been dropped", k, v)
				}
			}
			if msg.UUID != "u" || msg.Metadata.Get("keep") != "me" {
				t.Errorf("UUID %q keep %q", msg.UUID, msg.Metadata.Get("keep"))
			}
		})
	}
}

func TestMarshalerUnmarshalUUID(t *testing.T) {
	m := Marshaler{}
	// Neither a UUID header nor a message-id: a generated UUID, a different
	// one for each message, carried by the copy.
	msg, err := m.Unmarshal(amqp.Delivery{Body: []byte("x")})
	if err != nil || len(msg.UUID) != 36 {
		t.Fatalf("no headers: UUID %q err %v", msg.UUID, err)
	}
	msg2, err := m.Unmarshal(amqp.Delivery{Body: []byte("x"), Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: ""}})
	if err != nil || len(msg2.UUID) != 36 || msg2.UUID == msg.UUID {
		t.Fatalf("empty UUID header: UUID %q (first message %q) err %v", msg2.UUID, msg.UUID, err)
	}
	p, err := m.Marshal(msg)
	if err != nil || p.Headers[wamqp.DefaultMessageUUIDHeaderKey] != msg.UUID || p.MessageId != "" {
		t.Fatalf("copy: UUID header %v message-id %q err %v, want %q and no message-id", p.Headers[wamqp.DefaultMessageUUIDHeaderKey], p.MessageId, err, msg.UUID)
	}
	again, err := m.Unmarshal(deliveryFromPublishing(p, "", "q"))
	if err != nil || again.UUID != msg.UUID {
		t.Fatalf("the copy's delivery has UUID %q, want %q", again.UUID, msg.UUID)
	}
	// No UUID header: MessageId is used.
	msg, err = m.Unmarshal(amqp.Delivery{MessageId: "mid-1", Headers: amqp.Table{"a": "b"}})
	if err != nil || msg.UUID != "mid-1" {
		t.Fatalf("MessageId fallback: UUID %q err %v", msg.UUID, err)
	}
	// The UUID header wins over MessageId.
	msg, err = m.Unmarshal(amqp.Delivery{MessageId: "mid-1", Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: "u-1"}})
	if err != nil || msg.UUID != "u-1" {
		t.Fatalf("UUID header: UUID %q err %v", msg.UUID, err)
	}
	// A non-string UUID header is converted.
	msg, err = m.Unmarshal(amqp.Delivery{Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: []byte("u-bytes")}})
	if err != nil || msg.UUID != "u-bytes" {
		t.Fatalf("[]byte UUID: UUID %q err %v", msg.UUID, err)
	}
	// A custom inner marshaler with its own UUID header key.
	for _, inner := range []wamqp.Marshaler{
		wamqp.DefaultMarshaler{MessageUUIDHeaderKey: "id"},
		&wamqp.DefaultMarshaler{MessageUUIDHeaderKey: "id"},
	} {
		cm := Marshaler{Inner: inner}
		msg, err = cm.Unmarshal(amqp.Delivery{Headers: amqp.Table{"id": int64(7), "x-delivery-count": int64(1)}})
		if err != nil || msg.UUID != "7" || msg.Metadata.Get(retrymeta.XDeliveryCountKey) != "1" {
			t.Fatalf("%T custom key: UUID %q metadata %v err %v", inner, msg.UUID, msg.Metadata, err)
		}
		if cm.uuidHeaderKey() != "id" {
			t.Fatalf("uuidHeaderKey = %q", cm.uuidHeaderKey())
		}
	}
}

func TestMarshalerMarshalStripsDeliveryHeaders(t *testing.T) {
	msg := message.NewMessage("uuid-9", []byte("body"))
	stripped := []string{
		"x-death", "x-first-death-queue", "x-first-death-reason", "x-first-death-exchange",
		"x-last-death-queue", "x-last-death-reason", "x-last-death-exchange", "x-delivery-count",
		middleware.XDeathKey, retrymeta.XDeliveryCountKey,
		retrymeta.DeliveryExchangeKey, retrymeta.DeliveryRoutingKeyKey,
		retrymeta.HeaderErrorKey, confirm.PublishIDHeader,
	}
	for _, k := range stripped {
		msg.Metadata.Set(k, "v")
	}
	kept := map[string]string{
		"user":                            "u",
		middleware.AttemptKey:             "2",
		middleware.OriginalQueueKey:       "A",
		middleware.OriginalExchangeKey:    "",
		"x-custom":                        "x",
		"x-deathly":                       "not a broker header",
		wamqp.DefaultMessageUUIDHeaderKey: "uuid-9",
	}
	for k, v := range kept {
		if k != wamqp.DefaultMessageUUIDHeaderKey {
			msg.Metadata.Set(k, v)
		}
	}
	before := maps.Clone(msg.Metadata)

	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	if !maps.Equal(msg.Metadata, before) {
		t.Fatal("Marshal mutated the message metadata")
	}
	for _, k := range stripped {
		if v, ok := p.Headers[k]; ok {
			t.Errorf("publishing header %q = %v should be stripped", k, v)
		}
	}
	for k, v := range kept {
		if p.Headers[k] != v {
			t.Errorf("publishing header %q = %v, want %q", k, p.Headers[k], v)
		}
	}
	if len(p.Headers) != len(kept) {
		t.Errorf("publishing headers %v, want exactly %v", p.Headers, kept)
	}
	if string(p.Body) != "body" || p.DeliveryMode != amqp.Persistent {
		t.Errorf("body %q delivery mode %d", p.Body, p.DeliveryMode)
	}
}

func TestMarshalerRoundTrip(t *testing.T) {
	m := Marshaler{}
	d := brokerDelivery()
	msg, err := m.Unmarshal(d)
	if err != nil {
		t.Fatal(err)
	}
	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	// User headers keep their AMQP types (a timestamp comes back as
	// amqp091-go decodes one: time.Unix(seconds, 0)); the others are strings.
	typed := map[string]interface{}{"num": int32(5), "flag": true, "ts": time.Unix(xdeathTestTime.Unix(), 0)}
	for k, v := range p.Headers {
		if want, ok := typed[k]; ok {
			if !reflect.DeepEqual(v, want) {
				t.Errorf("publishing header %q = %T %#v, want %T %#v", k, v, v, want, want)
			}
		} else if _, ok := v.(string); !ok {
			t.Errorf("publishing header %q is %T, want string", k, v)
		}
	}
	for k := range typed {
		if _, ok := p.Headers[k]; !ok {
			t.Errorf("publishing lost header %q", k)
		}
	}
	// Read back, the copy gives the handler the same metadata.
	back, err := m.Unmarshal(deliveryFromPublishing(p, "ex", "rk"))
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"user-key", "num", "flag", "ts", retrymeta.TypedHeadersKey} {
		if back.Metadata[k] != msg.Metadata[k] {
			t.Errorf("metadata %q: %q on the copy, %q on the original", k, back.Metadata[k], msg.Metadata[k])
		}
	}
	// A message whose headers are all strings gives a copy readable by the
	// plain watermill marshaler.
	d.Headers = amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: "uuid-1", "user-key": "user-value", "x-death": d.Headers["x-death"]}
	msg, err = m.Unmarshal(d)
	if err != nil {
		t.Fatal(err)
	}
	if p, err = m.Marshal(msg); err != nil {
		t.Fatal(err)
	}
	plain, err := wamqp.DefaultMarshaler{}.Unmarshal(deliveryFromPublishing(p, "ex", "rk"))
	if err != nil {
		t.Fatalf("DefaultMarshaler cannot read the marshaled copy: %v", err)
	}
	want := message.Metadata{"user-key": "user-value", middleware.OriginalExchangeKey: "", middleware.OriginalRoutingKeyKey: "B"}
	if plain.UUID != "uuid-1" || string(plain.Payload) != "payload" || !maps.Equal(plain.Metadata, want) {
		t.Fatalf("copy: UUID %q payload %q metadata %v, want metadata %v", plain.UUID, plain.Payload, plain.Metadata, want)
	}
}

func TestTruncateHeaders(t *testing.T) {
	long := strings.Repeat("e", 5000)
	h := amqp.Table{
		middleware.LastErrorKey: long,
		poisonReasonKey:         long + long,
		"user-long":             strings.Repeat("u", 3000), // never truncated
		"n":                     int64(1),                  // counted with its AMQP size (9 bytes), never cut
		middleware.AttemptKey:   "3",
	}
	truncateHeaders(h, 8000)
	if got := headerBytes(h); got > 8000 {
		t.Fatalf("total %d > 8000 after truncation: %v", got, lens(h))
	}
	if h["user-long"] != strings.Repeat("u", 3000) || h["n"] != int64(1) || h[middleware.AttemptKey] != "3" {
		t.Fatalf("non-candidate headers changed: %v", lens(h))
	}
	a, b := h[middleware.LastErrorKey].(string), h[poisonReasonKey].(string)
	if !strings.HasSuffix(a, truncatedSuffix) || !strings.HasSuffix(b, truncatedSuffix) {
		t.Fatalf("truncated values lack the marker: %q... %q...", a[:20], b[:20])
	}
	// Both are cut to the same level (the longest is not left intact).
	if len(a) != len(b) {
		t.Errorf("levels differ: %d vs %d", len(a), len(b))
	}
	// The result uses the budget well: at most a few bytes are left unused.
	if got := headerBytes(h); got < 8000-4 {
		t.Errorf("total %d wastes budget", got)
	}

	// Within budget: untouched.
	h2 := amqp.Table{middleware.LastErrorKey: long}
	truncateHeaders(h2, 1<<20)
	if h2[middleware.LastErrorKey] != long {
		t.Fatal("value within budget was truncated")
	}

	// Only a short candidate and a big user header: candidate cut to the
	// marker, total stays above the budget, no panic.
	h3 := amqp.Table{"user": strings.Repeat("u", 500), middleware.LastErrorKey: strings.Repeat("e", 100)}
	truncateHeaders(h3, 100)
	if h3[middleware.LastErrorKey] != truncatedSuffix || len(h3["user"].(string)) != 500 {
		t.Fatalf("h3 = %v", lens(h3))
	}

	// UTF-8 is never split.
	h4 := amqp.Table{middleware.LastErrorKey: strings.Repeat("é", 1000)}
	for limit := 40; limit < 80; limit++ {
		c := maps.Clone(h4)
		truncateHeaders(c, limit)
		s := c[middleware.LastErrorKey].(string)
		if !utf8.ValidString(s) || headerBytes(c) > limit {
			t.Fatalf("limit %d: %q (%d bytes)", limit, s, headerBytes(c))
		}
	}

	// Through Marshal, with the field and its defaults.
	msg := message.NewMessage("u", nil)
	msg.Metadata.Set(middleware.LastErrorKey, strings.Repeat("e", 20000))
	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if got := headerBytes(p.Headers); got > defaultMaxHeaderBytes {
		t.Fatalf("default limit: total %d", got)
	}
	if msg.Metadata.Get(middleware.LastErrorKey) != strings.Repeat("e", 20000) {
		t.Fatal("Marshal truncated the message's own metadata")
	}
	p, _ = Marshaler{MaxHeaderBytes: 1000}.Marshal(msg)
	if got := headerBytes(p.Headers); got > 1000 {
		t.Fatalf("limit 1000: total %d", got)
	}
	p, _ = Marshaler{MaxHeaderBytes: -1}.Marshal(msg)
	if p.Headers[middleware.LastErrorKey] != strings.Repeat("e", 20000) {
		t.Fatal("negative MaxHeaderBytes should disable truncation")
	}
}

func headerBytes(h amqp.Table) int {
	n := 0
	for k, v := range h {
		if s, ok := v.(string); ok {
			n += len(k) + len(s)
		} else {
			n += len(k) + wire.FieldSize(v)
		}
	}
	return n
}

func lens(h amqp.Table) map[string]int {
	out := map[string]int{}
	for k, v := range h {
		if s, ok := v.(string); ok {
			out[k] = len(s)
		}
	}
	return out
}

// FuzzMarshalerUnmarshal feeds deliveries with fuzzed header keys and values
// (strings, integers, x-death and x-delivery-count of any value) through
// Unmarshal and Marshal: neither may fail or panic, user headers survive, and
// the marshaled copy carries no broker-owned header.
func FuzzMarshalerUnmarshal(f *testing.F) {
	f.Add("user", "value", int64(1), "uuid", []byte("body"), "A", int64(1))
	f.Add("x-death", "forged", int64(-1), "", []byte{}, "", int64(-5))
	f.Add("x-first-death-queue", "A", int64(math.MaxInt64), "\xff", []byte("\x00"), "Q", int64(math.MaxInt32)+1)
	f.Add(wamqp.DefaultMessageUUIDHeaderKey, "u2", int64(0), "u1", []byte("b"), "Q", int64(0))
	f.Fuzz(func(t *testing.T, key, sval string, ival int64, uuid string, body []byte, dq string, dcount int64) {
		headers := amqp.Table{
			key:                     sval,
			"int-" + key:            ival,
			"x-death":               []interface{}{amqp.Table{"queue": dq, "reason": "rejected", "count": dcount, "time": time.Unix(ival%(1<<40), 0)}},
			"x-delivery-count":      ival,
			confirm.PublishIDHeader: sval,
			"nested":                amqp.Table{key: []interface{}{sval, ival, body}},
			"x-last-death-queue":    dq,
		}
		if key != wamqp.DefaultMessageUUIDHeaderKey {
			headers[wamqp.DefaultMessageUUIDHeaderKey] = uuid
		}
		before := deepCopyTable(headers)
		d := amqp.Delivery{Headers: headers, Body: body, Exchange: "ex", RoutingKey: key}
		m := Marshaler{}
		msg, err := m.Unmarshal(d)
		if err != nil {
			t.Fatalf("Unmarshal: %v", err)
		}
		if !reflect.DeepEqual(d.Headers, before) {
			t.Fatal("Unmarshal mutated the delivery headers")
		}
		if string(msg.Payload) != string(body) {
			t.Fatal("payload changed")
		}
		// Keys the library treats specially, or that the literal above overwrites.
		special := isBrokerOwnedOrDeliveryOnly(key) || key == wamqp.DefaultMessageUUIDHeaderKey || key == "nested"
		if !special && msg.Metadata[key] != sval {
			t.Fatalf("metadata %q = %q, want %q", key, msg.Metadata[key], sval)
		}
		if key == wamqp.DefaultMessageUUIDHeaderKey {
			uuid = sval
		}
		if uuid == "" {
			// Neither a UUID header nor a message-id: a generated UUID.
			if len(msg.UUID) != 36 {
				t.Fatalf("UUID %q, want a generated one", msg.UUID)
			}
			uuid = msg.UUID
		}
		if msg.UUID != uuid {
			t.Fatalf("UUID %q, want %q", msg.UUID, uuid)
		}
		if xd, ok := msg.Metadata[middleware.XDeathKey]; ok {
			recs, err := amqpwire.ParseXDeath(xd)
			// JSON replaces invalid UTF-8 in the queue name with U+FFFD.
			if err != nil || len(recs) != 1 || (utf8.ValidString(dq) && recs[0].Queue != dq) || recs[0].Count != dcount {
				t.Fatalf("x-death metadata %q: %v %v", xd, recs, err)
			}
		} else if !strings.Contains(msg.Metadata[retrymeta.HeaderErrorKey], "x-death") {
			t.Fatalf("x-death dropped without a header error: %v", msg.Metadata)
		}
		if msg.Metadata.Get(retrymeta.DeliveryRoutingKeyKey) != key || msg.Metadata.Get(retrymeta.DeliveryExchangeKey) != "ex" {
			t.Fatal("delivery keys not set")
		}

		p, err := m.Marshal(msg)
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		for k, v := range p.Headers {
			if isBrokerOwnedOrDeliveryOnly(k) {
				t.Fatalf("publishing carries %q", k)
			}
			if _, ok := v.(string); ok {
				continue
			}
			// Only user headers go out typed, with the value they came with.
			if orig, ok := headers[k]; !ok || !keepsType(k, wamqp.DefaultMessageUUIDHeaderKey) || !sameWireValue(orig, v) {
				t.Fatalf("publishing header %q is %T %#v (delivered: %T %#v)", k, v, v, headers[k], headers[k])
			}
		}
		back, err := m.Unmarshal(deliveryFromPublishing(p, "", ""))
		if err != nil {
			t.Fatalf("copy not readable: %v", err)
		}
		if back.UUID != msg.UUID {
			t.Fatalf("copy UUID %q, want %q", back.UUID, msg.UUID)
		}
		if !special && !truncatable(key) && back.Metadata[key] != sval {
			t.Fatalf("copy metadata %q = %q, want %q", key, back.Metadata[key], sval)
		}
		if ik := "int-" + key; !isBrokerOwnedOrDeliveryOnly(ik) && !truncatable(ik) && back.Metadata[ik] != msg.Metadata[ik] {
			t.Fatalf("copy metadata %q = %q, want %q", ik, back.Metadata[ik], msg.Metadata[ik])
		}
	})
}

// --- Tests against a real RabbitMQ broker ---------------------------------

// brokerGet polls basic.get on queue until a message arrives or 10s pass.
func brokerGet(t *testing.T, ch *amqp.Channel, queue string) amqp.Delivery {
	t.Helper()
	var d amqp.Delivery
	waitFor(t, 10*time.Second, "a message in queue "+queue, func() bool {
		got, ok, err := ch.Get(queue, false)
		if err != nil {
			t.Fatalf("basic.get on %q: %v", queue, err)
		}
		d = got
		return ok
	})
	return d
}

func brokerPublish(t *testing.T, ch *amqp.Channel, queue string, p amqp.Publishing) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ch.PublishWithContext(ctx, "", queue, true, false, p); err != nil {
		t.Fatalf("publish to %q: %v", queue, err)
	}
}

func newUserMessage() *message.Message {
	msg := message.NewMessage("uuid-broker-1", []byte(`{"order":42}`))
	msg.Metadata.Set("user-key", "user-value")
	msg.Metadata.Set(middleware.AttemptKey, "1")
	return msg
}

// assertCleanCopy marshals msg and checks that the publishing carries no
// broker-owned or delivery-only header while payload, UUID and user metadata
// are intact.
func assertCleanCopy(t *testing.T, msg *message.Message) amqp.Publishing {
	t.Helper()
	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatalf("Marshal: %v", err)
	}
	for k := range p.Headers {
		if k == "x-death" || k == "x-delivery-count" || strings.HasPrefix(k, "x-first-death-") ||
			strings.HasPrefix(k, "x-last-death-") || k == retrymeta.DeliveryExchangeKey ||
			k == retrymeta.DeliveryRoutingKeyKey || k == retrymeta.HeaderErrorKey || k == confirm.PublishIDHeader {
			t.Errorf("publishing still carries %q = %v", k, p.Headers[k])
		}
	}
	if string(p.Body) != `{"order":42}` || p.Headers[wamqp.DefaultMessageUUIDHeaderKey] != "uuid-broker-1" ||
		p.Headers["user-key"] != "user-value" || p.Headers[middleware.AttemptKey] != "1" {
		t.Errorf("payload or user headers changed: body %q headers %v", p.Body, p.Headers)
	}
	return p
}

func TestMarshalerBrokerDeadLetteredMessage(t *testing.T) {
	ch := testChannel(t)
	qa := uniqueName(t, "marshal-a")
	qb := uniqueName(t, "marshal-b")
	qc := uniqueName(t, "marshal-c")
	declareTempQueue(t, ch, qb, nil)
	declareTempQueue(t, ch, qc, nil)
	declareTempQueue(t, ch, qa, amqp.Table{
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": qb,
	})

	p, err := wamqp.DefaultMarshaler{}.Marshal(newUserMessage())
	if err != nil {
		t.Fatal(err)
	}
	brokerPublish(t, ch, qa, p)
	first := brokerGet(t, ch, qa)
	if err := first.Nack(false, false); err != nil { // dead-letter to B, reason "rejected"
		t.Fatalf("nack: %v", err)
	}
	d := brokerGet(t, ch, qb)
	defer func() { _ = d.Ack(false) }()

	if _, ok := d.Headers["x-death"]; !ok {
		t.Fatalf("dead-lettered delivery has no x-death: %v", d.Headers)
	}
	if _, err := (wamqp.DefaultMarshaler{}).Unmarshal(d); err == nil {
		t.Fatal("wamqp.DefaultMarshaler accepted a dead-lettered delivery; expected the x-death failure (watermill issue #65)")
	} else {
		t.Logf("DefaultMarshaler.Unmarshal fails as expected: %v", err)
	}

	msg, err := Marshaler{}.Unmarshal(d)
	if err != nil {
		t.Fatalf("Marshaler.Unmarshal: %v", err)
	}
	if he, ok := msg.Metadata[retrymeta.HeaderErrorKey]; ok {
		t.Fatalf("unexpected header error: %s", he)
	}
	recs, err := amqpwire.ParseXDeath(msg.Metadata.Get(middleware.XDeathKey))
	if err != nil {
		t.Fatalf("ParseXDeath(%q): %v", msg.Metadata.Get(middleware.XDeathKey), err)
	}
	if len(recs) != 1 {
		t.Fatalf("x-death records %+v, want one", recs)
	}
	r := recs[0]
	if r.Queue != qa || r.Reason != "rejected" || r.Count != 1 || r.Exchange != "" ||
		!reflect.DeepEqual(r.RoutingKeys, []string{qa}) {
		t.Fatalf("x-death record %+v, want queue %s reason rejected count 1 routing-keys [%s]", r, qa, qa)
	}
	if r.Time.IsZero() || time.Since(r.Time) > time.Hour || r.Time.Location() != time.UTC {
		t.Errorf("x-death time %v", r.Time)
	}
	for k, v := range map[string]string{
		"x-first-death-queue":           qa,
		"x-first-death-reason":          "rejected",
		"x-first-death-exchange":        "",
		retrymeta.DeliveryExchangeKey:   "",
		retrymeta.DeliveryRoutingKeyKey: qb,
		"user-key":                      "user-value",
	} {
		if got, ok := msg.Metadata[k]; !ok || got != v {
			t.Errorf("metadata %q = %q (present %v), want %q", k, got, ok, v)
		}
	}
	if msg.UUID != "uuid-broker-1" || string(msg.Payload) != `{"order":42}` {
		t.Errorf("UUID %q payload %q", msg.UUID, msg.Payload)
	}

	// The cleaned copy travels through the broker and is readable by the
	// plain watermill marshaler: no broker header came back.
	cp := assertCleanCopy(t, msg)
	brokerPublish(t, ch, qc, cp)
	dc := brokerGet(t, ch, qc)
	defer func() { _ = dc.Ack(false) }()
	back, err := wamqp.DefaultMarshaler{}.Unmarshal(dc)
	if err != nil {
		t.Fatalf("republished copy not readable by DefaultMarshaler: %v", err)
	}
	if back.UUID != "uuid-broker-1" || back.Metadata.Get("user-key") != "user-value" {
		t.Errorf("republished copy: UUID %q metadata %v", back.UUID, back.Metadata)
	}
	if _, ok := back.Metadata["x-death"]; ok {
		t.Error("republished copy carries x-death")
	}
}

func TestMarshalerBrokerQuorumDeliveryCount(t *testing.T) {
	ch := testChannel(t)
	uri := brokerURI(t)
	q := uniqueName(t, "marshal-quorum")
	// Quorum queues must be durable ("Quorum Queues"), so declareTempQueue
	// (non-durable) cannot be used.
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatalf("declaring quorum queue: %v", err)
	}
	t.Cleanup(func() {
		conn, err := amqp.Dial(uri)
		if err != nil {
			t.Errorf("cleanup dial: %v", err)
			return
		}
		defer conn.Close()
		c, err := conn.Channel()
		if err != nil {
			t.Errorf("cleanup channel: %v", err)
			return
		}
		if _, err := c.QueueDelete(q, false, false, false); err != nil {
			t.Errorf("cleanup: deleting %q: %v", q, err)
		}
	})

	p, err := wamqp.DefaultMarshaler{}.Marshal(newUserMessage())
	if err != nil {
		t.Fatal(err)
	}
	brokerPublish(t, ch, q, p)
	first := brokerGet(t, ch, q)
	if err := first.Nack(false, true); err != nil { // requeue: the quorum queue counts it
		t.Fatalf("nack: %v", err)
	}
	d := brokerGet(t, ch, q)
	defer func() { _ = d.Ack(false) }()
	if !d.Redelivered {
		t.Error("second delivery not flagged redelivered")
	}
	// RabbitMQ 3.10 to 4.2 count a nack with requeue in x-delivery-count;
	// 4.3 does not (only basic.reject and crashes count) and sets
	// x-acquired-count instead. Both are numeric headers the Marshaler must
	// read; the library itself counts redeliveries from the redelivered flag.
	countKey := "x-delivery-count"
	raw, ok := d.Headers[countKey]
	if !ok {
		countKey = "x-acquired-count"
		if raw, ok = d.Headers[countKey]; !ok {
			t.Fatalf("redelivered quorum delivery has neither x-delivery-count nor x-acquired-count: %v", d.Headers)
		}
	}
	t.Logf("%s decoded as %T(%v)", countKey, raw, raw)
	if _, err := (wamqp.DefaultMarshaler{}).Unmarshal(d); err == nil {
		t.Fatalf("wamqp.DefaultMarshaler accepted a delivery with a numeric %s", countKey)
	}

	msg, err := Marshaler{}.Unmarshal(d)
	if err != nil {
		t.Fatalf("Marshaler.Unmarshal: %v", err)
	}
	if got := msg.Metadata.Get(countKey); got != "1" {
		t.Fatalf("metadata %s = %q, want \"1\" (metadata %v)", countKey, got, msg.Metadata)
	}
	if msg.Metadata.Get(retrymeta.DeliveryRedeliveredKey) != "true" {
		t.Errorf("redelivered flag not in metadata: %v", msg.Metadata)
	}
	if he, ok := msg.Metadata[retrymeta.HeaderErrorKey]; ok {
		t.Fatalf("unexpected header error: %s", he)
	}
	if msg.UUID != "uuid-broker-1" || msg.Metadata.Get("user-key") != "user-value" ||
		msg.Metadata.Get(retrymeta.DeliveryRoutingKeyKey) != q {
		t.Errorf("UUID %q metadata %v", msg.UUID, msg.Metadata)
	}
	assertCleanCopy(t, msg)
}
