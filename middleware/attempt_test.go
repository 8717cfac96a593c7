package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

func newCounter(t *testing.T, sources ...middleware.AttemptSource) *middleware.AttemptCounter {
	t.Helper()
	c, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: sources})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// countVia runs msg through c.Middleware and returns the attempt the handler
// saw in its context and in its metadata.
func countVia(t *testing.T, c *middleware.AttemptCounter, msg *message.Message) (ctxAttempt int, mdAttempt string) {
	t.Helper()
	called := 0
	_, err := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
		called++
		n, ok := middleware.AttemptFromContext(m.Context())
		if !ok {
			t.Fatal("no attempt in context")
		}
		if got := middleware.Attempt(m); got != n {
			t.Fatalf("Attempt(msg) = %d, context says %d", got, n)
		}
		ctxAttempt, mdAttempt = n, m.Metadata.Get(middleware.AttemptKey)
		return nil, nil
	})(msg)
	if err != nil || called != 1 {
		t.Fatalf("err %v, handler called %d times", err, called)
	}
	return ctxAttempt, mdAttempt
}

func TestAttemptCounterHeader(t *testing.T) {
	c := newAMQPCounter(t) // header + x-death + nack count (amqpretry.New's sources)
	tests := []struct {
		name    string
		header  *string
		want    int
		wantBad bool
	}{
		{"no header", nil, 1, false},
		{"header 1", ptr("1"), 1, false},
		{"header 3", ptr("3"), 3, false},
		{"header 1000", ptr("1000"), 1000, false},
		{"non-numeric", ptr("abc"), 1, true},
		{"empty", ptr(""), 1, true},
		{"negative", ptr("-5"), 1, true},
		{"huge negative", ptr("-99999999999999999999"), 1, true},
		{"zero", ptr("0"), 1, true},
		{"float", ptr("2.5"), 1, true},
		{"overflow int64", ptr("99999999999999999999"), middleware.MaxAttemptsCap, false},
		{"above cap", ptr("5000"), middleware.MaxAttemptsCap, false},
		{"cap plus one", ptr("1001"), middleware.MaxAttemptsCap, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			msg := ownCopy(newMsg("p"))
			if tc.header != nil {
				msg.Metadata.Set(middleware.AttemptKey, *tc.header)
			}
			n, bad := c.Count(msg)
			if n != tc.want {
				t.Errorf("Count = %d, want %d", n, tc.want)
			}
			if (bad != "") != tc.wantBad {
				t.Errorf("Count problem = %q, wantBad %v", bad, tc.wantBad)
			}
			ctxN, md := countVia(t, c, msg)
			if ctxN != tc.want || md != strconv.Itoa(tc.want) {
				t.Errorf("middleware: context %d, metadata %q; want %d", ctxN, md, tc.want)
			}
			he, hasHE := msg.Metadata[retrymeta.HeaderErrorKey]
			if hasHE != tc.wantBad {
				t.Errorf("HeaderErrorKey present %v (%q), want %v", hasHE, he, tc.wantBad)
			}
			if tc.wantBad && (!strings.Contains(he, "header") || !strings.Contains(he, middleware.AttemptKey)) {
				t.Errorf("HeaderErrorKey %q does not name the source and key", he)
			}
		})
	}
}

func ptr(s string) *string { return &s }

func xdeathFixture() []amqpwire.DeathRecord {
	return []amqpwire.DeathRecord{
		{Queue: "Q", Reason: "rejected", Count: 2, Exchange: "ex", RoutingKeys: []string{"rk"}, Time: time.Unix(1700000000, 0).UTC()},
		{Queue: "Q.wait.1s", Reason: "expired", Count: 5},
		{Queue: "other", Reason: "rejected", Count: 7},
	}
}

func TestAttemptCounterXDeathInRouter(t *testing.T) {
	c := newAMQPCounter(t) // XDeathSource(nil): the router's subscribe topic is the queue

	t.Run("x-death only", func(t *testing.T) {
		msg := ownCopy(newMsg("p"))
		msg.Metadata.Set(middleware.XDeathKey, wire.EncodeXDeath(xdeathFixture()))
		res := deliverViaRouter(t, "Q", msg, c.Middleware, func(*message.Message) ([]*message.Message, error) { return nil, nil })
		if n, _ := middleware.AttemptFromContext(res.seenCtx); n != 3 {
			t.Fatalf("attempt %d, want 1 + 2 rejections from Q = 3", n)
		}
		if got := res.seenMeta.Get(middleware.AttemptKey); got != "3" {
			t.Fatalf("metadata attempt %q, want 3", got)
		}
		if _, bad := res.seenMeta[retrymeta.HeaderErrorKey]; bad {
			t.Fatalf("unexpected header error %q", res.seenMeta[retrymeta.HeaderErrorKey])
		}
	})

	t.Run("x-death plus header", func(t *testing.T) {
		msg := ownCopy(newMsg("p"))
		msg.Metadata.Set(middleware.AttemptKey, "2")
		msg.Metadata.Set(middleware.XDeathKey, wire.EncodeXDeath(xdeathFixture()))
		res := deliverViaRouter(t, "Q", msg, c.Middleware, func(*message.Message) ([]*message.Message, error) { return nil, nil })
		if n, _ := middleware.AttemptFromContext(res.seenCtx); n != 4 {
			t.Fatalf("attempt %d, want 1 + 1 (header 2) + 2 (x-death) = 4", n)
		}
	})

	t.Run("other topic ignores Q's records", func(t *testing.T) {
		msg := ownCopy(newMsg("p"))
		msg.Metadata.Set(middleware.XDeathKey, wire.EncodeXDeath(xdeathFixture()))
		res := deliverViaRouter(t, "other", msg, c.Middleware, func(*message.Message) ([]*message.Message, error) { return nil, nil })
		if n, _ := middleware.AttemptFromContext(res.seenCtx); n != 8 {
			t.Fatalf("attempt %d, want 1 + 7 = 8", n)
		}
	})
}

func TestXDeathSource(t *testing.T) {
	queueQ := func(*message.Message) string { return "Q" }
	src := amqpwire.XDeathSource(queueQ)
	prev := func(recs string) (int64, error) {
		msg := ownCopy(newMsg("p"))
		if recs != "" {
			msg.Metadata.Set(middleware.XDeathKey, recs)
		}
		return src.Previous(msg)
	}

	if n, err := prev(""); n != 0 || err != nil {
		t.Errorf("absent: %d, %v", n, err)
	}
	if n, err := prev(wire.EncodeXDeath(xdeathFixture())); n != 2 || err != nil {
		t.Errorf("fixture: %d, %v; want 2", n, err)
	}
	withLimit := append(xdeathFixture(), amqpwire.DeathRecord{Queue: "Q", Reason: "delivery_limit", Count: 4}, amqpwire.DeathRecord{Queue: "Q", Reason: "maxlen", Count: 100})
	if n, err := prev(wire.EncodeXDeath(withLimit)); n != 6 || err != nil {
		t.Errorf("with delivery_limit: %d, %v; want 2 + 4 = 6", n, err)
	}
	if _, err := prev(`{"queue": "Q"`); err == nil {
		t.Error("malformed JSON must be an error")
	}
	if _, err := prev(`{"queue": "Q", "reason": "rejected", "count": 1}`); err == nil {
		t.Error("an object instead of an array must be an error")
	}
	if _, err := prev(wire.EncodeXDeath([]amqpwire.DeathRecord{{Queue: "Q", Reason: "rejected", Count: -1}})); err == nil {
		t.Error("negative count must be an error")
	}
	big := []amqpwire.DeathRecord{{Queue: "Q", Reason: "rejected", Count: 600}, {Queue: "Q", Reason: "delivery_limit", Count: 900}}
	if n, err := prev(wire.EncodeXDeath(big)); n != middleware.MaxAttemptsCap || err != nil {
		t.Errorf("large counts: %d, %v; want cap", n, err)
	}
	if n, err := prev(wire.EncodeXDeath([]amqpwire.DeathRecord{{Queue: "Q", Reason: "rejected", Count: 1 << 62}})); n != middleware.MaxAttemptsCap || err != nil {
		t.Errorf("huge count: %d, %v; want cap", n, err)
	}
	tooMany := make([]amqpwire.DeathRecord, wire.MaxDeathRecords+1)
	for i := range tooMany {
		tooMany[i] = amqpwire.DeathRecord{Queue: "Q", Reason: "rejected", Count: 1}
	}
	if _, err := prev(wire.EncodeXDeath(tooMany)); err == nil {
		t.Error("more than MaxDeathRecords records must be an error")
	}
}

func TestParseEncodeXDeathRoundTrip(t *testing.T) {
	recs := xdeathFixture()
	got, err := amqpwire.ParseXDeath(wire.EncodeXDeath(recs))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(recs) {
		t.Fatalf("got %d records", len(got))
	}
	for i := range recs {
		if got[i].Queue != recs[i].Queue || got[i].Reason != recs[i].Reason || got[i].Count != recs[i].Count ||
			got[i].Exchange != recs[i].Exchange || !got[i].Time.Equal(recs[i].Time) || len(got[i].RoutingKeys) != len(recs[i].RoutingKeys) {
			t.Errorf("record %d: got %+v, want %+v", i, got[i], recs[i])
		}
	}
	if recs, err := amqpwire.ParseXDeath(""); recs != nil || err != nil {
		t.Errorf("empty: %v, %v", recs, err)
	}
}

func TestAttemptCounterMalformedXDeathIgnored(t *testing.T) {
	c := newCounter(t, middleware.HeaderSource(nil), amqpwire.XDeathSource(func(*message.Message) string { return "Q" }))
	msg := ownCopy(newMsg("p"))
	msg.Metadata.Set(middleware.AttemptKey, "2")
	msg.Metadata.Set(middleware.XDeathKey, `[{"queue":"Q","reason":"rejected","count":`)
	n, md := countVia(t, c, msg)
	if n != 2 || md != "2" {
		t.Fatalf("attempt %d (%q), want 2 from the header alone", n, md)
	}
	he := msg.Metadata.Get(retrymeta.HeaderErrorKey)
	if !strings.HasPrefix(he, "x-death: ") {
		t.Fatalf("HeaderErrorKey %q should name the x-death source", he)
	}
}

func TestAttemptCounterTwoBadSources(t *testing.T) {
	c := newCounter(t, middleware.HeaderSource(nil), amqpwire.DeliveryCountSource())
	msg := ownCopy(newMsg("p"))
	msg.Metadata.Set(middleware.AttemptKey, "abc")
	msg.Metadata.Set(retrymeta.XDeliveryCountKey, "-1")
	n, bad := c.Count(msg)
	if n != 1 {
		t.Fatalf("attempt %d, want 1", n)
	}
	parts := strings.Split(bad, "; ")
	if len(parts) != 2 || !strings.HasPrefix(parts[0], "header: ") || !strings.HasPrefix(parts[1], "x-delivery-count: ") {
		t.Fatalf("problem %q should list both sources", bad)
	}
}

func TestDeliveryCountSource(t *testing.T) {
	// Not a default source.
	def := newCounter(t)
	msg := ownCopy(newMsg("p"))
	msg.Metadata.Set(retrymeta.XDeliveryCountKey, "4")
	if n, _ := def.Count(msg); n != 1 {
		t.Fatalf("default counter counted x-delivery-count: %d", n)
	}

	c := newCounter(t, middleware.HeaderSource(nil), amqpwire.DeliveryCountSource())
	tests := []struct {
		header, count string
		want          int
		bad           bool
	}{
		{"", "", 1, false},
		{"", "0", 1, false},
		{"", "2", 3, false},
		{"3", "2", 5, false},
		{"3", "x", 3, true},
		{"3", "-2", 3, true},
		{"", "99999999999999999999", middleware.MaxAttemptsCap, false},
		{"900", "500", middleware.MaxAttemptsCap, false},
	}
	for _, tc := range tests {
		msg := ownCopy(newMsg("p"))
		if tc.header != "" {
			msg.Metadata.Set(middleware.AttemptKey, tc.header)
		}
		if tc.count != "" {
			msg.Metadata.Set(retrymeta.XDeliveryCountKey, tc.count)
		}
		n, bad := c.Count(msg)
		if n != tc.want || (bad != "") != tc.bad {
			t.Errorf("header %q count %q: got %d %q, want %d bad=%v", tc.header, tc.count, n, bad, tc.want, tc.bad)
		}
	}
}

func TestAttemptCounterCustomSource(t *testing.T) {
	calls := 0
	src := middleware.AttemptSource{Name: "custom", Previous: func(*message.Message) (int64, error) {
		calls++
		if calls == 2 {
			return 0, errors.New("flaky")
		}
		return 4, nil
	}}
	c := newCounter(t, src)
	if n, bad := c.Count(ownCopy(newMsg("p"))); n != 5 || bad != "" {
		t.Fatalf("got %d %q, want 5", n, bad)
	}
	if n, bad := c.Count(ownCopy(newMsg("p"))); n != 1 || bad != "custom: flaky" {
		t.Fatalf("got %d %q, want 1 and \"custom: flaky\"", n, bad)
	}
}

func TestAttemptCounterConfigValidate(t *testing.T) {
	prev := func(*message.Message) (int64, error) { return 0, nil }
	if _, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: []middleware.AttemptSource{{Previous: prev}}}); err == nil || !strings.Contains(err.Error(), "Sources[0].Name") {
		t.Errorf("missing name: %v", err)
	}
	if _, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: []middleware.AttemptSource{{Name: "a", Previous: prev}, {Name: "b"}}}); err == nil || !strings.Contains(err.Error(), "Sources[1].Previous") {
		t.Errorf("missing Previous: %v", err)
	}
}

func TestAttemptFallbackWithoutCounter(t *testing.T) {
	tests := []struct {
		header string
		want   int
	}{
		{"", 1}, {"1", 1}, {"4", 4}, {"abc", 1}, {"-3", 1}, {"0", 1}, {"5000", middleware.MaxAttemptsCap}, {"99999999999999999999", middleware.MaxAttemptsCap},
	}
	for _, tc := range tests {
		msg := ownCopy(newMsg("p"))
		if tc.header != "" {
			msg.Metadata.Set(middleware.AttemptKey, tc.header)
		}
		if got := middleware.Attempt(msg); got != tc.want {
			t.Errorf("Attempt with header %q = %d, want %d", tc.header, got, tc.want)
		}
	}
	// The context wins over the metadata.
	msg := ownCopy(newMsg("p"))
	msg.Metadata.Set(middleware.AttemptKey, "4")
	msg.SetContext(middleware.ContextWithAttempt(msg.Context(), 7))
	if got := middleware.Attempt(msg); got != 7 {
		t.Errorf("Attempt = %d, want the context's 7", got)
	}
	if _, ok := middleware.AttemptFromContext(nilContext()); ok {
		t.Error("AttemptFromContext(nil) reported an attempt")
	}
}

func TestAttemptCounterIsSafeForConcurrentUse(t *testing.T) {
	c := newCounter(t)
	errs := make(chan error, 50)
	for i := range 50 {
		go func() {
			msg := ownCopy(newMsg("p"))
			msg.Metadata.Set(middleware.AttemptKey, strconv.Itoa(i%7+1))
			_, err := c.Middleware(func(m *message.Message) ([]*message.Message, error) {
				if got := middleware.Attempt(m); got != i%7+1 {
					return nil, fmt.Errorf("message %d: attempt %d", i, got)
				}
				return nil, nil
			})(msg)
			errs <- err
		}()
	}
	for range 50 {
		if err := recv(t, errs, 5*time.Second); err != nil {
			t.Error(err)
		}
	}
}

// Issue #18 item 1: only this queue's own evidence counts. A first delivery
// here (no retry route: a producer's message, another queue chain's copy)
// is attempt 1 whatever it carries; a DeadLetterFirstRetry comeback counts
// its x-death for Q but not the producer's header; a native return counts
// the nacks only when redelivered.
func TestAttemptCounterOwnEvidenceOnly(t *testing.T) {
	qf := func(*message.Message) string { return "Q" }
	c := newCounter(t, middleware.HeaderSource(qf), amqpwire.XDeathSource(qf), amqpwire.NackCountSource()) // the defaults, queue Q
	q := func(msg *message.Message) *message.Message { return msg }
	amqpFirst := func(md map[string]string) *message.Message {
		msg := q(newMsg("p"))
		msg.Metadata.Set(retrymeta.DeliveryExchangeKey, "business")
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		return msg
	}
	xdQ := func(n int64) string {
		return wire.EncodeXDeath([]amqpwire.DeathRecord{{Queue: "Q", Reason: "rejected", Count: n}})
	}
	tests := []struct {
		name string
		msg  *message.Message
		want int
	}{
		{"amqp first delivery, attempt 99", amqpFirst(map[string]string{middleware.AttemptKey: "99"}), 1},
		{"amqp first delivery, attempt cap", amqpFirst(map[string]string{middleware.AttemptKey: "1000"}), 1},
		{"amqp first delivery, x-death 50 for Q", amqpFirst(map[string]string{middleware.XDeathKey: xdQ(50)}), 1},
		{"amqp first delivery, forged retry-path keys are dropped by the Marshaler; OriginalQueueKey alone is no evidence",
			amqpFirst(map[string]string{middleware.AttemptKey: "7", middleware.OriginalQueueKey: "Q"}), 1},
		{"amqp first delivery, forged x-acquired-count", amqpFirst(map[string]string{retrymeta.XAcquiredCountKey: "9"}), 1},
		{"dead-letter-first comeback: x-death counts, producer header does not",
			amqpFirst(map[string]string{retrymeta.DeliveryRetryRouteKey: "true", middleware.AttemptKey: "99", middleware.XDeathKey: xdQ(1)}), 2},
		{"own copy via wait queue", amqpFirst(map[string]string{retrymeta.DeliveryRetryRouteKey: "true",
			retrymeta.DeliveryRetryPathKey: "true", middleware.AttemptKey: "3"}), 3},
		{"native returns: 3 nacks, 1 crash", amqpFirst(map[string]string{retrymeta.DeliveryRedeliveredKey: "true",
			retrymeta.XAcquiredCountKey: "4", retrymeta.XDeliveryCountKey: "1", middleware.AttemptKey: "99"}), 4},
		{"gochannel, attempt 99 from a producer", q(newMsg("p")), 1},
		{"gochannel, another queue's chain", func() *message.Message {
			m := q(newMsg("p"))
			m.Metadata.Set(middleware.AttemptKey, "4")
			m.Metadata.Set(middleware.OriginalQueueKey, "payments")
			return m
		}(), 1},
		{"gochannel, x-death 50 for Q", func() *message.Message {
			m := q(newMsg("p"))
			m.Metadata.Set(middleware.XDeathKey, xdQ(50))
			return m
		}(), 1},
		{"gochannel, this queue's own copy", func() *message.Message {
			m := q(newMsg("p"))
			m.Metadata.Set(middleware.AttemptKey, "4")
			m.Metadata.Set(middleware.OriginalQueueKey, "Q")
			return m
		}(), 4},
	}
	for _, tc := range tests {
		if tc.name == "gochannel, attempt 99 from a producer" {
			tc.msg.Metadata.Set(middleware.AttemptKey, "99")
		}
		if n, bad := c.Count(tc.msg); n != tc.want || bad != "" {
			t.Errorf("%s: attempt %d (%q), want %d", tc.name, n, bad, tc.want)
		}
	}
}

func TestNackCountSource(t *testing.T) {
	src := amqpwire.NackCountSource()
	for _, tc := range []struct {
		redelivered     bool
		acquired, count string
		want            int64
		wantErr         bool
	}{
		{false, "5", "", 0, false},
		{true, "", "", 0, false},
		{true, "3", "", 3, false},
		{true, "3", "1", 2, false},
		{true, "1", "3", 0, false},
		{true, "x", "", 0, true},
		{true, "3", "-1", 0, true},
		{true, "99999999999999999999", "", middleware.MaxAttemptsCap, false},
	} {
		msg := newMsg("p")
		if tc.redelivered {
			msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
		}
		if tc.acquired != "" {
			msg.Metadata.Set(retrymeta.XAcquiredCountKey, tc.acquired)
		}
		if tc.count != "" {
			msg.Metadata.Set(retrymeta.XDeliveryCountKey, tc.count)
		}
		n, err := src.Previous(msg)
		if n != tc.want || (err != nil) != tc.wantErr {
			t.Errorf("%+v: %d, %v", tc, n, err)
		}
	}
}

// nilContext returns a nil context.Context (AttemptFromContext documents
// that it accepts one) without a literal nil argument.
func nilContext() context.Context { return nil }

// newAMQPCounter is a counter with the sources amqpretry.New gives the chain
// (this queue's attempt header, its own x-death entries, the nack count).
func newAMQPCounter(t *testing.T) *middleware.AttemptCounter {
	t.Helper()
	return newCounter(t, middleware.HeaderSource(nil), amqpwire.XDeathSource(nil), amqpwire.NackCountSource())
}
