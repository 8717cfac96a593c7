package audit_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// exactEnv is two topic exchanges (tenant A's and tenant B's), each with a
// business queue bound "#", audited by a Consumer into PostgreSQL.
type exactEnv struct {
	t        *testing.T
	uri      string
	ch       *amqp.Channel
	exA, exB string
	qA, qB   string
	naming   audit.Naming
	store    *pgstore.Store
	cons     *audit.Consumer
	resender *audit.Resender
}

func newExactEnv(t *testing.T, mod func(*audit.ConsumerConfig)) *exactEnv {
	t.Helper()
	e := &exactEnv{t: t, uri: testkit.URI(t),
		exA: testkit.UniqueName(t, "ex.a"), exB: testkit.UniqueName(t, "ex.b"),
		qA: testkit.UniqueName(t, "q.a"), qB: testkit.UniqueName(t, "q.b"),
		naming: audit.Naming{Exchange: testkit.UniqueName(t, "audit"), AttemptsQueue: testkit.UniqueName(t, "audit.att"), ArrivalsQueue: testkit.UniqueName(t, "audit.arr")}}
	conn, err := amqp.Dial(e.uri)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if e.ch, err = conn.Channel(); err != nil {
		t.Fatal(err)
	}
	for _, p := range [][2]string{{e.exA, e.qA}, {e.exB, e.qB}} {
		if err := e.ch.ExchangeDeclare(p[0], "topic", false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := e.ch.QueueDeclare(p[1], false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := e.ch.QueueBind(p[1], "#", p[0], false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		c, err := conn.Channel()
		if err != nil {
			return
		}
		_ = audit.DeleteTopology(c, e.naming)
		for _, q := range []string{e.qA, e.qB} {
			_, _ = c.QueueDelete(q, false, false, false)
		}
		for _, x := range []string{e.exA, e.exB} {
			_ = c.ExchangeDelete(x, false, false)
		}
	})
	e.store, _ = pgStore(t)
	cfg := audit.ConsumerConfig{URI: e.uri, Store: e.store, Naming: e.naming, QueueType: audit.QueueTypeClassic,
		BatchWait: 20 * time.Millisecond, Exchanges: []audit.Binding{{Exchange: e.exA}, {Exchange: e.exB}}}
	if mod != nil {
		mod(&cfg)
	}
	if e.cons, err = audit.NewConsumer(cfg); err != nil {
		t.Fatal(err)
	}
	if err := e.cons.Declare(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.cons.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Consumer.Run: %v", err)
		}
	})
	mgmt := testkit.MgmtURI()
	if e.resender, err = audit.NewResender(audit.ResenderConfig{URI: e.uri, Store: e.store, ConfirmTimeout: 10 * time.Second,
		ArrivalsQueue: e.naming.ArrivalsQueue, ManagementURL: mgmt, SkipRouteCheck: mgmt == ""}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.resender.Close() })
	if err := e.ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	return e
}

// publish publishes p to exchange with key and waits for its confirm.
func (e *exactEnv) publish(exchange, key string, p amqp.Publishing) {
	e.t.Helper()
	c, err := e.ch.PublishWithDeferredConfirmWithContext(context.Background(), exchange, key, true, false, p)
	if err != nil {
		e.t.Fatal(err)
	}
	if ok, err := c.WaitContext(context.Background()); !ok || err != nil {
		e.t.Fatalf("publish to %s not confirmed: %v %v", exchange, ok, err)
	}
}

// take gets every message of q until want arrived (then checks none is
// left over).
func (e *exactEnv) take(q string, want int) []amqp.Delivery {
	e.t.Helper()
	tp := &resendTopology{ch: e.ch}
	return tp.drain(e.t, q, want)
}

func (e *exactEnv) waitArrivals(f audit.Filter, want int) []audit.Message {
	e.t.Helper()
	var msgs []audit.Message
	testkit.WaitFor(e.t, 15*time.Second, fmt.Sprintf("%d arrivals matching %+v recorded", want, f), func() bool {
		var err error
		msgs, err = e.store.Search(context.Background(), f)
		n := 0
		for _, m := range msgs {
			n += m.ArrivalCount
		}
		return err == nil && n >= want
	})
	return msgs
}

// Issue #19 item 5: one message id published on two exchanges (two
// tenants' systems that reuse ids). Search by the second exchange must
// show the second's arrival, a resend filtered to tenant B must publish
// B's body to B's exchange, and a resend by the id alone (which matches
// both, with different bodies) must publish nothing: skipped as
// ambiguous, never A's or B's silently.
func TestAuditSameIDOnTwoExchanges(t *testing.T) {
	e := newExactEnv(t, nil)
	const id = "shared-id-1"
	for _, p := range []struct{ ex, tenant string }{{e.exA, "A"}, {e.exB, "B"}} {
		e.publish(p.ex, "order.created", amqp.Publishing{
			Headers: amqp.Table{audit.DefaultUUIDHeader: id, "tenant": p.tenant}, Body: []byte("body of tenant " + p.tenant),
			Timestamp: time.Now(),
		})
	}
	e.take(e.qA, 1)
	e.take(e.qB, 1)
	e.waitArrivals(audit.Filter{MessageID: id}, 2)

	msgs, err := e.store.Search(context.Background(), audit.Filter{Exchange: e.exB})
	if err != nil || len(msgs) != 1 || msgs[0].Arrival == nil {
		t.Fatalf("search by exchange B: %+v %v", msgs, err)
	}
	if a := msgs[0].Arrival; a.Exchange != e.exB || string(a.Body) != "body of tenant B" {
		t.Fatalf("search by exchange B shows the arrival on %s with body %q", a.Exchange, a.Body)
	}

	rep, err := e.resender.Resend(context.Background(), audit.Filter{Headers: map[string]any{"tenant": "B"}}, audit.ResendOptions{Mode: audit.ResendToExchange, AllowAll: true})
	if err != nil || rep.Sent != 1 {
		t.Fatalf("resend tenant B: %+v %v", rep, err)
	}
	gotB := e.take(e.qB, 1)
	e.take(e.qA, 0)
	if string(gotB[0].Body) != "body of tenant B" || gotB[0].Headers["tenant"] != "B" {
		t.Fatalf("tenant B's resend published body %q tenant %v", gotB[0].Body, gotB[0].Headers["tenant"])
	}

	// The resent copy is a third arrival of the id (with rabbitretry-resent:
	// not a different content).
	e.waitArrivals(audit.Filter{MessageID: id}, 3)
	rep, err = e.resender.Resend(context.Background(), audit.Filter{MessageID: id}, audit.ResendOptions{Mode: audit.ResendToExchange})
	if err != nil || rep.Sent != 0 || rep.Skipped != 1 || !strings.Contains(rep.Results[0].Error, "ambiguous") {
		t.Fatalf("resend of the ambiguous id: %+v %v", rep, err)
	}
	e.take(e.qA, 0)
	e.take(e.qB, 0)
	t.Logf("ACCOUNT TestAuditSameIDOnTwoExchanges: published=2 handled=1 poisoned=0 duplicates=0 lost=0 (resend of tenant B: 1 to B, 0 to A; ambiguous resend by id: %s)", rep.Results[0].Error)
}

// everyFieldType is one header of every AMQP field value type amqp091-go
// writes and reads (its write.go writeField / read.go readField: t, b, B,
// s, u, I, i, l, f, d, D, S, x, T, F, A, V), with values JSON cannot keep
// exactly.
func everyFieldType() amqp.Table {
	return amqp.Table{
		"bool":      true,
		"int8":      int8(-8),
		"uint8":     uint8(200),
		"int16":     int16(-16000),
		"uint16":    uint16(65000),
		"int32":     int32(-7),
		"uint32":    uint32(4_000_000_000),
		"int64":     int64(1)<<53 + 1,
		"float32":   float32(1.5),
		"float64":   float64(3),
		"float-max": math.MaxFloat64,
		"decimal":   amqp.Decimal{Scale: 2, Value: -12345},
		"string":    "héllo",
		"bytes":     []byte{0, 1, 0xfe, 0xff},
		"timestamp": time.Unix(1_790_000_000, 0),
		"void":      nil,
		"table":     amqp.Table{"i32": int32(5), "f": float64(2), "b": []byte("x"), "d": amqp.Decimal{Scale: 1, Value: 7}},
		"array":     []any{int32(1), int64(1) << 60, "s", []byte{9}, time.Unix(1, 0), amqp.Table{"u8": uint8(1)}, []any{float32(0.25)}},
	}
}

// normal makes decoded header values comparable: times in UTC.
func normal(v any) any {
	switch x := v.(type) {
	case time.Time:
		return x.UTC()
	case amqp.Table:
		o := amqp.Table{}
		for k, e := range x {
			o[k] = normal(e)
		}
		return o
	case []any:
		o := make([]any, len(x))
		for i, e := range x {
			o[i] = normal(e)
		}
		return o
	}
	return v
}

// Issue #19 item 7: every AMQP field type round-trips exactly, value and
// type, from the original publish through the audit's store to the
// resent copy (a resend used to turn int64 2^53+1 into a float, bytes into
// base64 text, a decimal into a float, a timestamp into text, int32 into
// int64 and float 3 into an int).
func TestAuditHeadersRoundTripExactly(t *testing.T) {
	e := newExactEnv(t, nil)
	h := everyFieldType()
	h[audit.DefaultUUIDHeader] = "typed-1"
	e.publish(e.exA, "order.created", amqp.Publishing{Headers: h, Body: []byte("typed"), Timestamp: time.Now()})
	orig := e.take(e.qA, 1)[0]
	e.waitArrivals(audit.Filter{MessageID: "typed-1"}, 1)
	rep, err := e.resender.Resend(context.Background(), audit.Filter{MessageID: "typed-1"}, audit.ResendOptions{Mode: audit.ResendToExchange})
	if err != nil || rep.Sent != 1 {
		t.Fatalf("resend: %+v %v", rep, err)
	}
	copy := e.take(e.qA, 1)[0]
	for k := range copy.Headers {
		if strings.HasPrefix(k, "rabbitretry-") { // rabbitretry-resent, and the publisher's rabbitretry-publish-id
			delete(copy.Headers, k)
		}
	}
	changed := 0
	for k, want := range orig.Headers {
		got, ok := copy.Headers[k]
		if !ok || !reflect.DeepEqual(normal(got), normal(want)) {
			changed++
			t.Errorf("header %q: sent %T %#v, resent %T %#v", k, want, want, got, got)
		}
	}
	for k, v := range copy.Headers {
		if _, ok := orig.Headers[k]; !ok {
			changed++
			t.Errorf("resent header %q = %#v was not sent", k, v)
		}
	}
	t.Logf("ACCOUNT TestAuditHeadersRoundTripExactly: published=1 handled=1 poisoned=0 duplicates=0 lost=0 (headers %d, changed by the resend %d)", len(orig.Headers), changed)
}

// Issue #19 item 9: anyone allowed to publish to the audit exchange could
// forge an attempt record and flip a message's last outcome. Records now
// carry the AMQP user-id, which RabbitMQ validates against the publishing
// connection's user; the Consumer stores only its RecorderUsers' records.
// The Recorder's record is stored (RecordedBy = its user); a forged record
// without user-id is refused (Stats.Untrusted) and the last outcome stays;
// a forged user-id is refused by the broker itself (406).
func TestAuditRefusesForgedAttemptRecords(t *testing.T) {
	e := newExactEnv(t, nil)
	const id = "forge-1"
	rec, err := audit.NewRecorder(audit.RecorderConfig{URI: e.uri, Naming: e.naming, QueueType: audit.QueueTypeClassic,
		QueueName: func(context.Context) string { return "orders" }})
	if err != nil {
		t.Fatal(err)
	}
	_, herr := rec.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("boom")
	})(message.NewMessage(id, []byte("x")))
	if herr == nil {
		t.Fatal("handler error lost")
	}
	if err := rec.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	var msgs []audit.Message
	testkit.WaitFor(t, 15*time.Second, "the recorder's attempt stored", func() bool {
		msgs, err = e.store.Search(context.Background(), audit.Filter{MessageID: id})
		return err == nil && len(msgs) == 1 && len(msgs[0].Attempts) == 1
	})
	genuine := msgs[0].Attempts[0]
	user, _ := amqp.ParseURI(e.uri)
	if genuine.RecordedBy != user.Username || genuine.Outcome != audit.OutcomeNacked {
		t.Fatalf("recorder's attempt: %+v", genuine)
	}

	forged, _ := audit.MarshalAttempt(audit.Attempt{ID: "forged-1", MessageID: id, Queue: "orders", Attempt: 9,
		StartedAt: time.Now(), Outcome: audit.OutcomeSuccess, RecordedBy: user.Username})
	e.publish(e.naming.Exchange, audit.AttemptRoutingKey, amqp.Publishing{ContentType: "application/json", Body: forged})
	testkit.WaitFor(t, 15*time.Second, "the forged record refused", func() bool { return e.cons.Stats().Untrusted == 1 })

	// A user-id other than the connection's user: the broker refuses it.
	conn, err := amqp.Dial(e.uri)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	_ = ch.PublishWithContext(context.Background(), e.naming.Exchange, audit.AttemptRoutingKey, false, false,
		amqp.Publishing{UserId: "rabbitretry-recorder-" + user.Username, Body: forged})
	select {
	case ae := <-closed:
		if ae == nil || ae.Code != amqp.PreconditionFailed {
			t.Fatalf("channel closed with %v, want 406 PRECONDITION_FAILED", ae)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the broker accepted a user-id that is not the connection's user")
	}

	msgs, err = e.store.Search(context.Background(), audit.Filter{MessageID: id})
	if err != nil || len(msgs) != 1 || len(msgs[0].Attempts) != 1 || msgs[0].Attempts[0].ID != genuine.ID {
		t.Fatalf("after the forgeries: %+v %v", msgs, err)
	}
	if m, err := e.store.Search(context.Background(), audit.Filter{MessageID: id, LastOutcome: audit.OutcomeSuccess}); err != nil || len(m) != 0 {
		t.Fatalf("the forged record flipped the last outcome: %+v %v", m, err)
	}
	t.Logf("ACCOUNT TestAuditRefusesForgedAttemptRecords: published=3 handled=1 poisoned=0 duplicates=0 lost=0 (records: 1 genuine stored, 1 forged without user-id refused by the consumer, 1 with a foreign user-id refused by the broker)")
}

// Issue #19 item 8: a to-exchange resend to an exchange whose business
// binding is gone was reported "sent": the audit's own "#" binding routed
// the copies (a mandatory publish only says "routed somewhere"). Now the
// exchange's bindings are read from the management API first: such a
// message is reported failed (errRoutedOnlyToAudit) and not published, in
// a dry run too; with the binding back, it is sent.
func TestAuditResendToExchangeRoutedOnlyToAudit(t *testing.T) {
	testkit.HaveMgmt(t)
	e := newExactEnv(t, nil)
	const n = 20
	for i := range n {
		e.publish(e.exA, "order.created", amqp.Publishing{Headers: amqp.Table{audit.DefaultUUIDHeader: fmt.Sprintf("gone-%02d", i)}, Body: []byte(fmt.Sprint(i))})
	}
	e.take(e.qA, n)
	e.waitArrivals(audit.Filter{Exchange: e.exA}, n)
	if err := e.ch.QueueUnbind(e.qA, "#", e.exA, nil); err != nil {
		t.Fatal(err)
	}
	for _, dry := range []bool{true, false} {
		rep, err := e.resender.Resend(context.Background(), audit.Filter{Exchange: e.exA}, audit.ResendOptions{Mode: audit.ResendToExchange, DryRun: dry, AllowAll: true})
		if err != nil || rep.Sent != 0 || rep.Failed != n || !strings.Contains(rep.Results[0].Error, "only to the audit") {
			t.Fatalf("dry run %v: sent %d failed %d %v (%+v)", dry, rep.Sent, rep.Failed, err, rep.Results[0])
		}
	}
	// Nothing was published: no new arrival (the audit queue would have
	// recorded one per copy).
	if msgs, err := e.store.Search(context.Background(), audit.Filter{Exchange: e.exA, Limit: 100}); err != nil || len(msgs) != n {
		t.Fatalf("search: %d %v", len(msgs), err)
	}
	if err := e.ch.QueueBind(e.qA, "order.*", e.exA, false, nil); err != nil {
		t.Fatal(err)
	}
	rep, err := e.resender.Resend(context.Background(), audit.Filter{Exchange: e.exA}, audit.ResendOptions{Mode: audit.ResendToExchange, AllowAll: true})
	if err != nil || rep.Sent != n {
		t.Fatalf("with the binding back: %+v %v", rep, err)
	}
	e.take(e.qA, n)
	t.Logf("ACCOUNT TestAuditResendToExchangeRoutedOnlyToAudit: published=%d handled=%d poisoned=0 duplicates=0 lost=0 (binding gone: reported failed %d, sent 0; binding back: sent %d)", n, n, n, rep.Sent)
}
