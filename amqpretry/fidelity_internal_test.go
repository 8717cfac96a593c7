package amqpretry

import (
	"math"
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// sameWireValue reports whether a and b encode to the same AMQP field value
// (same type tag and bytes; a timestamp's time zone does not matter).
func sameWireValue(a, b interface{}) bool {
	ea, errA := wire.EncodeHeaderTable(amqp.Table{"v": a})
	eb, errB := wire.EncodeHeaderTable(amqp.Table{"v": b})
	return errA == nil && errB == nil && ea == eb
}

// allWireTypes has one header of every AMQP field type amqp091-go decodes,
// as it decodes them (a timestamp as time.Unix(s, 0), an empty array as a
// nil slice).
func allWireTypes() amqp.Table {
	return amqp.Table{
		"t": true, "f": false, "b": int8(-128), "B": uint8(255), "s": int16(math.MinInt16), "u": uint16(math.MaxUint16),
		"I": int32(math.MinInt32), "i": uint32(math.MaxUint32), "l": int64(math.MinInt64), "l-max": int64(math.MaxInt64),
		"f32": float32(-0.1), "f64": math.Inf(-1), "f32-nan": float32(math.NaN()), "D": amqp.Decimal{Scale: 255, Value: math.MinInt32},
		"S": "text\x00with nul", "x": []byte{0, 1, 0xff}, "x-empty": []byte{}, "T": time.Unix(-62135596800, 0), "T-now": time.Unix(1732345678, 0),
		"F": amqp.Table{"k": amqp.Table{"kk": []interface{}{int16(1), nil}}, "": "empty key"}, "F-empty": amqp.Table{},
		"A": []interface{}{int8(1), "s", []interface{}(nil), amqp.Table{"a": []byte("b")}, nil}, "A-empty": []interface{}(nil), "V": nil,
		strings.Repeat("k", 255): int32(1),
	}
}

func TestMarshalerTypedHeaders(t *testing.T) {
	m := Marshaler{}
	h := allWireTypes()
	h[wamqp.DefaultMessageUUIDHeaderKey] = "u"
	h[middleware.AttemptKey] = int32(2)     // a library key sent typed by a producer
	h["reason_poisoned"] = []byte("why")    // Watermill's poison key
	h[retrymeta.TypedHeadersKey] = "forged" // never taken from a header
	h["x-first-death-queue"] = []byte("")   // broker header: never carried
	msg, err := m.Unmarshal(amqp.Delivery{Headers: h, Body: []byte("b"), DeliveryTag: 1})
	if err != nil {
		t.Fatal(err)
	}
	if msg.Metadata["I"] != "-2147483648" || msg.Metadata["x"] != "\x00\x01\xff" || msg.Metadata[middleware.AttemptKey] != "2" {
		t.Errorf("metadata not readable strings: %q %q %q", msg.Metadata["I"], msg.Metadata["x"], msg.Metadata[middleware.AttemptKey])
	}
	if msg.Metadata[retrymeta.TypedHeadersKey] == "forged" || msg.Metadata[retrymeta.HeaderErrorKey] != "" {
		t.Errorf("typed key %q, header error %q", msg.Metadata[retrymeta.TypedHeadersKey], msg.Metadata[retrymeta.HeaderErrorKey])
	}
	msg.Metadata["i"] = "changed"
	delete(msg.Metadata, "F")
	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range allWireTypes() {
		switch k {
		case "i":
			if p.Headers[k] != "changed" {
				t.Errorf("changed header %q = %#v, want the handler's string", k, p.Headers[k])
			}
		case "F":
			if _, ok := p.Headers[k]; ok {
				t.Errorf("deleted header %q is back", k)
			}
		default:
			if !sameWireValue(v, p.Headers[k]) {
				t.Errorf("header %q = %T %#v, want %T %#v", k, p.Headers[k], p.Headers[k], v, v)
			}
		}
	}
	for _, k := range []string{middleware.AttemptKey, "reason_poisoned", wamqp.DefaultMessageUUIDHeaderKey} {
		if _, ok := p.Headers[k].(string); !ok {
			t.Errorf("library key %q goes out as %T, want string", k, p.Headers[k])
		}
	}
	for _, k := range []string{retrymeta.TypedHeadersKey, "x-first-death-queue"} {
		if _, ok := p.Headers[k]; ok {
			t.Errorf("publishing carries %q", k)
		}
	}
	// An unreadable TypedHeadersKey (a handler wrote it): everything as strings.
	msg.Metadata[retrymeta.TypedHeadersKey] = "%%%"
	p, err = m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := p.Headers["I"].(string); !ok {
		t.Errorf("with an unreadable typed key, header I is %T", p.Headers["I"])
	}
}

// Delivery mode: kept as the producer sent it (1 or 2); a delivery without
// one gives persistent copies (Inner's default).
func TestMarshalerDeliveryMode(t *testing.T) {
	m := Marshaler{}
	for _, tc := range []struct{ in, want uint8 }{{amqp.Transient, amqp.Transient}, {amqp.Persistent, amqp.Persistent}, {0, amqp.Persistent}} {
		msg, err := m.Unmarshal(amqp.Delivery{DeliveryMode: tc.in, Body: []byte("b"), DeliveryTag: 1})
		if err != nil {
			t.Fatal(err)
		}
		p, err := m.Marshal(msg)
		if err != nil {
			t.Fatal(err)
		}
		if p.DeliveryMode != tc.want {
			t.Errorf("delivery mode %d: copy has %d, want %d", tc.in, p.DeliveryMode, tc.want)
		}
		if _, ok := p.Headers[retrymeta.PropDeliveryModeKey]; ok {
			t.Errorf("delivery mode travels as a header too")
		}
	}
	// It wins over an Inner that makes transient publishings.
	cm := Marshaler{Inner: wamqp.DefaultMarshaler{NotPersistentDeliveryMode: true}}
	msg, _ := cm.Unmarshal(amqp.Delivery{DeliveryMode: amqp.Persistent, Body: []byte("b"), DeliveryTag: 1})
	if p, _ := cm.Marshal(msg); p.DeliveryMode != amqp.Persistent {
		t.Errorf("persistent message copied with mode %d", p.DeliveryMode)
	}
}

// retryPathDelivery: only the loop-back exchange, or a wait queue's
// dead-lettering through the default exchange, with no death in Q itself.
func TestRetryPathDelivery(t *testing.T) {
	topo := newTopology(func() Naming { n := Naming{LoopBackExchange: "lb"}; n.setDefaults(); return n }(),
		[]time.Duration{200 * time.Millisecond, time.Second}, QueueTypeClassic, false, nil)
	death := func(q, reason string) amqpwire.DeathRecord {
		return amqpwire.DeathRecord{Queue: q, Reason: reason, Count: 1}
	}
	cases := []struct {
		name      string
		exchange  string
		deaths    []amqpwire.DeathRecord
		def, topo bool // with the default naming, with topo
	}{
		{"business exchange", "orders", nil, false, false},
		{"business exchange, forged expiry", "orders", []amqpwire.DeathRecord{death("Q.wait.1s", "expired")}, false, false},
		{"default loop-back", "rabbitretry.loopback", nil, true, false},
		{"configured loop-back", "lb", nil, false, true},
		{"wait queue expiry", "", []amqpwire.DeathRecord{death("Q.wait.1s", "expired")}, true, true},
		{"wait queue expiry, ms tier", "", []amqpwire.DeathRecord{death("Q.wait.200ms", "expired")}, true, true},
		{"unknown tier (removed by a deploy)", "", []amqpwire.DeathRecord{death("Q.wait.7s", "expired")}, true, true},
		{"not a tier", "", []amqpwire.DeathRecord{death("Q.wait.x1s", "expired")}, false, false},
		{"another queue's wait queue", "", []amqpwire.DeathRecord{death("P.wait.1s", "expired")}, false, false},
		{"older expiry", "", []amqpwire.DeathRecord{death("X", "expired"), death("Q.wait.1s", "expired")}, false, false},
		{"rejected in Q (dead-letter first retry)", "", []amqpwire.DeathRecord{death("Q.wait.1s", "expired"), death("Q", "rejected")}, false, false},
		{"delivery limit in Q", "rabbitretry.loopback", []amqpwire.DeathRecord{death("Q", "delivery_limit")}, false, false},
		{"default exchange, no death", "", nil, false, false},
	}
	for _, tc := range cases {
		d := amqp.Delivery{Exchange: tc.exchange, RoutingKey: "Q"}
		if got := (Marshaler{}).retryPathDelivery(&d, tc.deaths); got != tc.def {
			t.Errorf("%s, default naming: %v, want %v", tc.name, got, tc.def)
		}
		if got := (Marshaler{Topology: topo}).retryPathDelivery(&d, tc.deaths); got != tc.topo {
			t.Errorf("%s, Topology: %v, want %v", tc.name, got, tc.topo)
		}
	}
	// The route (DeliveryRetryRouteKey) ignores deaths in Q: a
	// DeadLetterFirstRetry comeback is on the route, not a copy.
	for _, tc := range []struct {
		name     string
		exchange string
		deaths   []amqpwire.DeathRecord
		want     bool
	}{
		{"dead-letter first retry back from the wait queue", "", []amqpwire.DeathRecord{death("Q.wait.1s", "expired"), death("Q", "rejected")}, true},
		{"delivery limit, back through the loop-back", "rabbitretry.loopback", []amqpwire.DeathRecord{death("Q", "delivery_limit")}, true},
		{"business exchange with a forged rejection in Q", "orders", []amqpwire.DeathRecord{death("Q", "rejected")}, false},
		{"default exchange, forged rejection in Q", "", []amqpwire.DeathRecord{death("Q", "rejected")}, false},
	} {
		d := amqp.Delivery{Exchange: tc.exchange, RoutingKey: "Q"}
		if route, _ := (Marshaler{}).retryRoute(&d, tc.deaths); route != tc.want {
			t.Errorf("%s: route %v, want %v", tc.name, route, tc.want)
		}
	}
	// Dead-lettered out of Q since the last publish: a copy of the library
	// only if the broker's x-first-death headers say its first dead-lettering
	// was in a wait queue, a cascade level, or in Q after the loop-back.
	for _, tc := range []struct {
		name     string
		fq, fx   string
		copyOf   bool
		withTopo bool
	}{
		{"producer's message, dead-letter first retry", "Q", "orders", false, false},
		{"no first-death headers", "", "", false, false},
		{"copy from a wait queue", "Q.wait.1s", "rabbitretry.wait", true, false},
		{"copy from a configured wait queue", "Q.wait.200ms", "w", true, true},
		{"zero-delay copy via the loop-back", "Q", "rabbitretry.loopback", true, false},
		{"zero-delay copy via the configured loop-back", "Q", "lb", true, true},
		{"copy from a cascade level", "d.level.03", "d.level.03", true, false},
		{"another queue's wait queue", "P.wait.1s", "rabbitretry.wait", false, false},
	} {
		d := amqp.Delivery{Exchange: "", RoutingKey: "Q", Headers: amqp.Table{}}
		if tc.fq != "" {
			d.Headers["x-first-death-queue"], d.Headers["x-first-death-exchange"] = tc.fq, tc.fx
		}
		m := Marshaler{}
		if tc.withTopo {
			m.Topology = topo
		}
		deaths := []amqpwire.DeathRecord{death("Q.wait.200ms", "expired"), death("Q", "rejected")}
		if route, copyOf := m.retryRoute(&d, deaths); !route || copyOf != tc.copyOf {
			t.Errorf("dead-lettered out of Q, %s: route %v copy %v, want true %v", tc.name, route, copyOf, tc.copyOf)
		}
	}
	// A delay cascade's delivery that the Topology does not know (a deploy
	// left the cascade): recognised by its shape.
	for _, tc := range []struct {
		name, exchange, key string
		deaths              []amqpwire.DeathRecord
		route, copyOf       bool
	}{
		{"from the delivery exchange", "d.delivery", "0.1.1.Q", []amqpwire.DeathRecord{death("d.level.00", "expired"), death("d.level.01", "expired")}, true, true},
		{"from a level exchange", "d.level.01", "1.1.0.Q", []amqpwire.DeathRecord{death("d.level.02", "expired")}, true, true},
		{"dead-lettered out of Q since", "d.delivery", "0.0.1.Q", []amqpwire.DeathRecord{death("d.level.00", "expired"), death("Q", "delivery_limit")}, true, false},
		{"no level death", "d.delivery", "0.0.1.Q", nil, false, false},
		{"another prefix's level", "d.delivery", "0.0.1.Q", []amqpwire.DeathRecord{death("e.level.00", "expired")}, false, false},
		{"business exchange", "orders", "0.0.1.Q", []amqpwire.DeathRecord{death("d.level.00", "expired")}, false, false},
		{"no bit words", "d.delivery", "Q", []amqpwire.DeathRecord{death("d.level.00", "expired")}, false, false},
	} {
		d := amqp.Delivery{Exchange: tc.exchange, RoutingKey: tc.key}
		route, copyOf := (Marshaler{}).retryRoute(&d, tc.deaths)
		if route != tc.route || copyOf != tc.copyOf {
			t.Errorf("cascade %s: route %v copy %v, want %v %v", tc.name, route, copyOf, tc.route, tc.copyOf)
		}
	}
}

// Origin keys on a delivery that did not come through the retry path are
// the delivery's, never a producer's; on a retry-path delivery they are
// kept, and the delivery is marked for RecordFailure.
func TestMarshalerOriginKeys(t *testing.T) {
	forged := amqp.Table{
		middleware.OriginalQueueKey: "other", middleware.OriginalExchangeKey: "evil", middleware.OriginalRoutingKeyKey: "evil.key",
		retrymeta.DeliveryRetryPathKey: "true", // never taken from a header
	}
	msg, err := Marshaler{}.Unmarshal(amqp.Delivery{Headers: forged, Exchange: "orders", RoutingKey: "order.created", DeliveryTag: 1})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{middleware.OriginalExchangeKey: "orders", middleware.OriginalRoutingKeyKey: "order.created"}
	for k, v := range want {
		if msg.Metadata[k] != v {
			t.Errorf("%s = %q, want %q", k, msg.Metadata[k], v)
		}
	}
	for _, k := range []string{middleware.OriginalQueueKey, retrymeta.DeliveryRetryPathKey} {
		if v, ok := msg.Metadata[k]; ok {
			t.Errorf("%s = %q, want absent", k, v)
		}
	}
	// A copy the library wrote, back through the loop-back exchange.
	lib := amqp.Table{middleware.OriginalQueueKey: "Q", middleware.OriginalExchangeKey: "orders", middleware.OriginalRoutingKeyKey: "order.created"}
	msg, err = Marshaler{}.Unmarshal(amqp.Delivery{Headers: lib, Exchange: "rabbitretry.loopback", RoutingKey: "Q", DeliveryTag: 1})
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range lib {
		if msg.Metadata[k] != v {
			t.Errorf("retry path: %s = %q, want %q", k, msg.Metadata[k], v)
		}
	}
	if msg.Metadata[retrymeta.DeliveryRetryPathKey] != "true" {
		t.Error("retry-path delivery not marked")
	}
	p, err := Marshaler{}.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := p.Headers[retrymeta.DeliveryRetryPathKey]; ok {
		t.Error("the retry-path mark travels on the wire")
	}
}
