package audit_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// resendMemStore is an in-memory audit.Store for the Resender tests: it
// filters on MessageID, Queue, Exchange and Headers (string values), newest
// first, and counts Search calls.
type resendMemStore struct {
	mu       sync.Mutex
	msgs     map[string]*audit.Message
	searches int
}

func newResendMemStore() *resendMemStore {
	return &resendMemStore{msgs: map[string]*audit.Message{}}
}

func (s *resendMemStore) Write(_ context.Context, arrivals []audit.Arrival, attempts []audit.Attempt) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	get := func(id string) *audit.Message {
		m := s.msgs[id]
		if m == nil {
			m = &audit.Message{MessageID: id}
			s.msgs[id] = m
		}
		return m
	}
	for _, a := range arrivals {
		a := a
		get(a.MessageID).Arrival = &a
	}
	for _, a := range attempts {
		m := get(a.MessageID)
		m.Attempts = append(m.Attempts, a)
	}
	return nil
}

func (s *resendMemStore) Search(_ context.Context, f audit.Filter) ([]audit.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.searches++
	var out []audit.Message
	for _, m := range s.msgs {
		if f.MessageID != "" && m.MessageID != f.MessageID {
			continue
		}
		if f.Exchange != "" && (m.Arrival == nil || m.Arrival.Exchange != f.Exchange) {
			continue
		}
		if len(f.Headers) > 0 {
			if m.Arrival == nil {
				continue
			}
			ok := true
			for k, v := range f.Headers {
				if !reflect.DeepEqual(m.Arrival.Headers[k], v) {
					ok = false
				}
			}
			if !ok {
				continue
			}
		}
		if f.Queue != "" {
			ok := false
			for _, a := range m.Attempts {
				ok = ok || a.Queue == f.Queue
			}
			if !ok {
				continue
			}
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].MessageID > out[j].MessageID })
	limit := f.Limit
	if limit == 0 {
		limit = 100
	}
	if len(out) > limit {
		out = out[:limit]
	}
	return out, nil
}

// resendTopology is a business exchange with two queues bound with the same
// key, both also bound to a loop-back exchange under their own names, as
// amqpretry declares them.
type resendTopology struct {
	ch                   *amqp.Channel
	loopBack, business   string
	key                  string
	q1, q2               string
	unboundEx, missingEx string
}

func newResendTopology(t *testing.T) *resendTopology {
	t.Helper()
	conn, err := amqp.Dial(testkit.URI(t))
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	tp := &resendTopology{
		ch:        ch,
		loopBack:  testkit.UniqueName(t, "loopback"),
		business:  testkit.UniqueName(t, "orders"),
		unboundEx: testkit.UniqueName(t, "unbound"),
		missingEx: testkit.UniqueName(t, "missing"),
		key:       "order.created",
		q1:        testkit.UniqueName(t, "billing"),
		q2:        testkit.UniqueName(t, "shipping"),
	}
	for _, ex := range []string{tp.loopBack, tp.business, tp.unboundEx} {
		if err := ch.ExchangeDeclare(ex, "direct", false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, q := range []string{tp.q1, tp.q2} {
		if _, err := ch.QueueDeclare(q, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(q, tp.key, tp.business, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(q, q, tp.loopBack, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		c, err := conn.Channel()
		if err != nil {
			return
		}
		for _, q := range []string{tp.q1, tp.q2} {
			_, _ = c.QueueDelete(q, false, false, false)
		}
		for _, ex := range []string{tp.loopBack, tp.business, tp.unboundEx} {
			_ = c.ExchangeDelete(ex, false, false)
		}
	})
	return tp
}

// drain takes every message from q (basic.get) until want arrived, then
// checks nothing more is there: the publishes were confirmed before, so
// they are enqueued.
func (tp *resendTopology) drain(t *testing.T, q string, want int) []amqp.Delivery {
	t.Helper()
	var got []amqp.Delivery
	testkit.WaitFor(t, 10*time.Second, fmt.Sprintf("%d messages in %s", want, q), func() bool {
		for {
			d, ok, err := tp.ch.Get(q, true)
			if err != nil {
				t.Fatalf("get %s: %v", q, err)
			}
			if !ok {
				break
			}
			got = append(got, d)
		}
		return len(got) >= want
	})
	qi, err := tp.ch.QueueDeclarePassive(q, false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != want || qi.Messages != 0 {
		t.Fatalf("%s: got %d messages (+%d left), want %d", q, len(got), qi.Messages, want)
	}
	return got
}

func resendArrival(id, exchange, key string, headers map[string]any, body string) audit.Arrival {
	return audit.Arrival{
		ID: "arr-" + id, MessageID: id, CorrelationID: "corr-" + id,
		Exchange: exchange, RoutingKey: key,
		PublishedAt: time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC),
		ArrivedAt:   time.Date(2026, 11, 24, 8, 0, 1, 0, time.UTC),
		Headers:     headers,
		Properties:  map[string]string{"content-type": "application/json", "delivery-mode": "2", "priority": "3", "app-id": "shop", "user-id": "someone-else"},
		Body:        []byte(body), BodySize: len(body),
	}
}

func newTestResender(t *testing.T, st audit.Store, tp *resendTopology) *audit.Resender {
	t.Helper()
	uri := "amqp://guest:guest@127.0.0.1:5672/"
	lb := "unused"
	if tp != nil {
		uri, lb = testkit.URI(t), tp.loopBack
	}
	mgmt := testkit.MgmtURI()
	r, err := audit.NewResender(audit.ResenderConfig{URI: uri, Store: st, LoopBackExchange: lb, ConfirmTimeout: 10 * time.Second,
		ManagementURL: mgmt, SkipRouteCheck: mgmt == ""})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func TestResendToQueueReachesOnlyThatQueue(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendMemStore()
	headers := map[string]any{
		"_watermill_message_uuid": "m-1", "tenant": "acme", "count": float64(7), "ratio": 0.5,
		"nested": map[string]any{"a": true}, "list": []any{"x", float64(2)},
		"rabbitretry-attempt": "3", "rabbitretry-delay-ms": float64(100), "x-death": []any{map[string]any{"count": float64(1)}},
	}
	_ = st.Write(context.Background(), []audit.Arrival{resendArrival("m-1", tp.business, tp.key, headers, `{"order":1}`)},
		[]audit.Attempt{
			{ID: "a1", MessageID: "m-1", Queue: tp.q1, Attempt: 1, StartedAt: time.Now().Add(-time.Minute), Outcome: audit.OutcomeRetry},
			{ID: "a2", MessageID: "m-1", Queue: tp.q1, Attempt: 2, StartedAt: time.Now(), Outcome: audit.OutcomePoisoned},
		})
	r := newTestResender(t, st, tp)
	rep, err := r.Resend(context.Background(), audit.Filter{MessageID: "m-1"}, audit.ResendOptions{Mode: audit.ResendToQueue})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Matched != 1 || rep.Sent != 1 || rep.Failed != 0 || rep.Skipped != 0 {
		t.Fatalf("report %+v", rep)
	}
	if res := rep.Results[0]; res.Queue != tp.q1 || res.Exchange != tp.loopBack || res.RoutingKey != tp.q1 || res.Status != auditconst.StatusSent {
		t.Fatalf("result %+v: want sent to the attempts' queue %s via %s", res, tp.q1, tp.loopBack)
	}
	got := tp.drain(t, tp.q1, 1)[0]
	tp.drain(t, tp.q2, 0) // bound to the same exchange and key: untouched
	t.Logf("accounting: matched 1, sent 1, received %s 1, %s 0", tp.q1, tp.q2)

	if string(got.Body) != `{"order":1}` || got.ContentType != "application/json" || got.DeliveryMode != 2 ||
		got.Priority != 3 || got.AppId != "shop" || got.UserId != "" || got.CorrelationId != "corr-m-1" ||
		!got.Timestamp.Equal(time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC)) {
		t.Fatalf("properties/body not as arrived: %+v", got)
	}
	for _, k := range []string{"rabbitretry-attempt", "rabbitretry-delay-ms", "x-death"} {
		if _, ok := got.Headers[k]; ok {
			t.Errorf("retry header %s carried over", k)
		}
	}
	if got.Headers["_watermill_message_uuid"] != "m-1" || got.Headers["tenant"] != "acme" ||
		got.Headers["count"] != int64(7) || got.Headers["ratio"] != 0.5 {
		t.Errorf("headers: %#v", got.Headers)
	}
	if got.Headers["rabbitretry-original-exchange"] != tp.business || got.Headers["rabbitretry-original-routing-key"] != tp.key {
		t.Errorf("to-queue copy lacks the true origin: %#v", got.Headers)
	}
	if n, ok := got.Headers["nested"].(amqp.Table); !ok || n["a"] != true {
		t.Errorf("nested header: %#v", got.Headers["nested"])
	}
	ts, _ := got.Headers[auditconst.ResentKey].(string)
	if at, err := time.Parse(time.RFC3339, ts); err != nil || time.Since(at) > time.Minute {
		t.Errorf("%s = %q, want the resend time in RFC 3339", auditconst.ResentKey, ts)
	}

	// Queue overrides the latest attempt's queue.
	rep, err = r.Resend(context.Background(), audit.Filter{MessageID: "m-1"}, audit.ResendOptions{Mode: audit.ResendToQueue, Queue: tp.q2})
	if err != nil || rep.Sent != 1 {
		t.Fatalf("override: %+v, %v", rep, err)
	}
	tp.drain(t, tp.q2, 1)
	tp.drain(t, tp.q1, 0)

	// Fan-out: the same message id consumed from both queues. No single
	// original queue: skipped unless the filter (or Queue) names one.
	_ = st.Write(context.Background(), []audit.Arrival{resendArrival("m-fan", tp.business, tp.key, nil, "fan")}, []audit.Attempt{
		{ID: "f1", MessageID: "m-fan", Queue: tp.q1, Attempt: 1, StartedAt: time.Now(), Outcome: audit.OutcomeSuccess},
		{ID: "f2", MessageID: "m-fan", Queue: tp.q2, Attempt: 1, StartedAt: time.Now(), Outcome: audit.OutcomePoisoned},
	})
	rep, err = r.Resend(context.Background(), audit.Filter{MessageID: "m-fan"}, audit.ResendOptions{Mode: audit.ResendToQueue})
	if err != nil || rep.Skipped != 1 || !strings.Contains(rep.Results[0].Error, "several queues") {
		t.Fatalf("fan-out without a queue: %+v, %v", rep, err)
	}
	rep, err = r.Resend(context.Background(), audit.Filter{MessageID: "m-fan", Queue: tp.q2}, audit.ResendOptions{Mode: audit.ResendToQueue})
	if err != nil || rep.Sent != 1 || rep.Results[0].Queue != tp.q2 {
		t.Fatalf("fan-out filtered by queue: %+v, %v", rep, err)
	}
	tp.drain(t, tp.q2, 1)
	tp.drain(t, tp.q1, 0)
}

func TestResendToExchangeReachesEveryBoundQueue(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendMemStore()
	_ = st.Write(context.Background(), []audit.Arrival{resendArrival("m-1", tp.business, tp.key,
		map[string]any{"rabbitretry-original-exchange": "forged", "x-death": []any{}, "keep": "me"}, "hello")}, nil)
	r := newTestResender(t, st, tp)
	rep, err := r.Resend(context.Background(), audit.Filter{MessageID: "m-1"}, audit.ResendOptions{Mode: audit.ResendToExchange})
	if err != nil || rep.Sent != 1 {
		t.Fatalf("%+v, %v", rep, err)
	}
	if res := rep.Results[0]; res.Exchange != tp.business || res.RoutingKey != tp.key {
		t.Fatalf("result %+v", res)
	}
	for _, q := range []string{tp.q1, tp.q2} {
		d := tp.drain(t, q, 1)[0]
		if string(d.Body) != "hello" || d.MessageId != "m-1" {
			t.Fatalf("%s got %q message-id %q (no UUID header: message-id carries the id)", q, d.Body, d.MessageId)
		}
		for k := range d.Headers {
			if k != "keep" && k != auditconst.ResentKey && k != confirm.PublishIDHeader {
				t.Fatalf("%s: header %s carried or added on a to-exchange resend: %#v", q, k, d.Headers)
			}
		}
	}
}

func TestResendByHeaderReachesExactlyTheIntendedMessages(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendMemStore()
	var arrivals []audit.Arrival
	var attempts []audit.Attempt
	acme := map[string]bool{}
	for i := range 20 {
		id := fmt.Sprintf("m-%02d", i)
		tenant := "globex"
		if i%3 == 0 {
			tenant = "acme"
			acme[id] = true
		}
		arrivals = append(arrivals, resendArrival(id, tp.business, tp.key, map[string]any{"tenant": tenant, "_watermill_message_uuid": id}, "body-"+id))
		attempts = append(attempts, audit.Attempt{ID: "a-" + id, MessageID: id, Queue: tp.q1, Attempt: 1, StartedAt: time.Now(), Outcome: audit.OutcomePoisoned})
	}
	_ = st.Write(context.Background(), arrivals, attempts)
	r := newTestResender(t, st, tp)
	rep, err := r.Resend(context.Background(), audit.Filter{Headers: map[string]any{"tenant": "acme"}}, audit.ResendOptions{Mode: audit.ResendToQueue})
	if err != nil {
		t.Fatal(err)
	}
	got := tp.drain(t, tp.q1, len(acme))
	tp.drain(t, tp.q2, 0)
	seen := map[string]bool{}
	prev := ""
	for _, d := range got {
		id, _ := d.Headers["_watermill_message_uuid"].(string)
		if !acme[id] || seen[id] || string(d.Body) != "body-"+id {
			t.Fatalf("received %q (body %q): not an acme message, or twice", id, d.Body)
		}
		if id < prev { // the store returns newest (highest id) first
			t.Fatalf("received %s after %s: not oldest first", id, prev)
		}
		seen[id], prev = true, id
	}
	if rep.Matched != len(acme) || rep.Sent != len(acme) || rep.Failed+rep.Skipped != 0 {
		t.Fatalf("report %+v", rep)
	}
	t.Logf("accounting: stored 20, matched %d, sent %d, received %d, others untouched %d (q2 0)", rep.Matched, rep.Sent, len(got), 20-len(acme))
}

func TestResendDryRunSendsNothing(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendMemStore()
	_ = st.Write(context.Background(), []audit.Arrival{resendArrival("m-1", tp.business, tp.key, nil, "x")}, nil)
	// A Resender with an unreachable broker: DryRun must not connect.
	r, err := audit.NewResender(audit.ResenderConfig{URI: "amqp://guest:guest@127.0.0.1:1/", Store: st, SkipRouteCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, mode := range []audit.ResendMode{audit.ResendToExchange, audit.ResendToQueue} {
		rep, err := r.Resend(context.Background(), audit.Filter{MessageID: "m-1"}, audit.ResendOptions{Mode: mode, Queue: map[audit.ResendMode]string{audit.ResendToQueue: tp.q1}[mode], DryRun: true})
		if err != nil || rep.Matched != 1 || rep.Sent != 1 || rep.Results[0].Status != auditconst.StatusWouldSend {
			t.Fatalf("%s: %+v, %v", mode, rep, err)
		}
	}
	// The real broker got nothing: a confirmed real resend is the only message.
	real := newTestResender(t, st, tp)
	if rep, err := real.Resend(context.Background(), audit.Filter{MessageID: "m-1"}, audit.ResendOptions{Mode: audit.ResendToExchange}); err != nil || rep.Sent != 1 {
		t.Fatalf("%+v %v", rep, err)
	}
	tp.drain(t, tp.q1, 1)
	tp.drain(t, tp.q2, 1)
}

func TestResendUnroutableAndSkippedAreReported(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendMemStore()
	trunc := resendArrival("m-trunc", tp.business, tp.key, nil, "abc")
	trunc.BodySize, trunc.BodyTruncated = 10, true
	_ = st.Write(context.Background(), []audit.Arrival{
		resendArrival("m-unbound", tp.unboundEx, "nowhere", nil, "u"),
		resendArrival("m-missing", tp.missingEx, tp.key, nil, "m"),
		resendArrival("m-ok", tp.business, tp.key, nil, "ok"),
		trunc,
	}, []audit.Attempt{{ID: "a-noarr", MessageID: "m-noarrival", Queue: tp.q1, Attempt: 1, StartedAt: time.Now(), Outcome: audit.OutcomePoisoned}})
	r := newTestResender(t, st, tp)
	rep, err := r.Resend(context.Background(), audit.Filter{}, audit.ResendOptions{Mode: audit.ResendToExchange, AllowAll: true})
	if err != nil {
		t.Fatal(err)
	}
	status := map[string]audit.ResendResult{}
	for _, res := range rep.Results {
		status[res.MessageID] = res
	}
	want := map[string]string{"m-unbound": auditconst.StatusFailed, "m-missing": auditconst.StatusFailed, "m-ok": auditconst.StatusSent,
		"m-trunc": auditconst.StatusSkipped, "m-noarrival": auditconst.StatusSkipped}
	for id, s := range want {
		if status[id].Status != s {
			t.Errorf("%s: %+v, want %s", id, status[id], s)
		}
	}
	if !strings.Contains(status["m-unbound"].Error, "unroutable") || !strings.Contains(status["m-missing"].Error, "not found") {
		t.Errorf("errors: %q / %q", status["m-unbound"].Error, status["m-missing"].Error)
	}
	if rep.Matched != 5 || rep.Sent != 1 || rep.Failed != 2 || rep.Skipped != 2 {
		t.Fatalf("report %+v", rep)
	}
	tp.drain(t, tp.q1, 1)
	tp.drain(t, tp.q2, 1)

	// To a queue not bound to the loop-back exchange: returned, failed.
	rep, err = r.Resend(context.Background(), audit.Filter{MessageID: "m-ok"}, audit.ResendOptions{Mode: audit.ResendToQueue, Queue: "no-such-queue-" + tp.q1})
	if err != nil || rep.Failed != 1 || !strings.Contains(rep.Results[0].Error, "unroutable") {
		t.Fatalf("unbound queue: %+v, %v", rep, err)
	}
	// No attempts: no queue known, skipped (not sent anywhere).
	rep, err = r.Resend(context.Background(), audit.Filter{MessageID: "m-ok"}, audit.ResendOptions{Mode: audit.ResendToQueue})
	if err != nil || rep.Skipped != 1 || !strings.Contains(rep.Results[0].Error, "no queue") {
		t.Fatalf("no attempts: %+v, %v", rep, err)
	}
	tp.drain(t, tp.q1, 0)
}

func TestResendRefusesBadInput(t *testing.T) {
	st := newResendMemStore()
	r := newTestResender(t, st, nil)
	ctx := context.Background()
	if _, err := r.Resend(ctx, audit.Filter{Limit: 5, Headers: map[string]any{}}, audit.ResendOptions{Mode: audit.ResendToQueue}); !errors.Is(err, audit.ErrEmptyFilter) {
		t.Fatalf("empty filter: %v", err)
	}
	for _, o := range []audit.ResendOptions{{}, {Mode: "sideways"}, {Mode: audit.ResendToExchange, Queue: "q"}, {Mode: audit.ResendToQueue, Limit: -1}} {
		if _, err := r.Resend(ctx, audit.Filter{MessageID: "x"}, o); err == nil || !strings.Contains(err.Error(), "ResendOptions.") {
			t.Errorf("%+v: %v, want a ResendOptions error", o, err)
		}
	}
	if st.searches != 0 {
		t.Fatalf("the store was searched %d times for refused input", st.searches)
	}
	for _, c := range []audit.ResenderConfig{{Store: st}, {URI: "amqp://x"}, {URI: "http://x", Store: st}} {
		if _, err := audit.NewResender(c); err == nil || !strings.Contains(err.Error(), "ResenderConfig.") {
			t.Errorf("%+v: %v", c, err)
		}
	}
	var report audit.ResendReport
	b, _ := json.Marshal(report)
	if !strings.Contains(string(b), `"results"`) {
		t.Errorf("report JSON %s", b)
	}
}

// A Resend whose context ends before it publishes reports every sendable
// message as unsent, and publishes nothing.
func TestResendCanceledReportsUnsent(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendMemStore()
	var arr []audit.Arrival
	for i := range 5 {
		arr = append(arr, resendArrival(fmt.Sprintf("m-%d", i), tp.business, tp.key, nil, "x"))
	}
	arr = append(arr, resendArrival("m-trunc", tp.business, tp.key, nil, "x"))
	arr[5].BodyTruncated, arr[5].BodySize = true, 10
	_ = st.Write(context.Background(), arr, nil)
	r := newTestResender(t, st, tp)
	// Connect first (a dry run does not), so only the publishing is canceled.
	if _, err := r.Resend(context.Background(), audit.Filter{MessageID: "none"}, audit.ResendOptions{Mode: audit.ResendToExchange}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rep, err := r.Resend(ctx, audit.Filter{Exchange: tp.business}, audit.ResendOptions{Mode: audit.ResendToExchange, AllowAll: true}) // every message of the store
	if !errors.Is(err, context.Canceled) || rep.Matched != 6 || rep.Unsent != 5 || rep.Skipped != 1 || rep.Sent+rep.Failed != 0 {
		t.Fatalf("%+v %v", rep, err)
	}
	for _, res := range rep.Results {
		if res.Status != auditconst.StatusUnsent && res.Status != auditconst.StatusSkipped {
			t.Fatalf("%+v", res)
		}
	}
	tp.drain(t, tp.q1, 0)
	tp.drain(t, tp.q2, 0)
}

// Within one pipelined batch, each message gets its own outcome: a queue
// that takes 2 messages and refuses more (x-max-length=2,
// x-overflow=reject-publish: the broker nacks) leaves 2 sent, 3 failed,
// in order.
func TestResendNackedInTheMiddleOfABatch(t *testing.T) {
	tp := newResendTopology(t)
	full := testkit.UniqueName(t, "full")
	if _, err := tp.ch.QueueDeclare(full, false, true, false, false, amqp.Table{"x-max-length": int32(2), "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	if err := tp.ch.QueueBind(full, full, tp.loopBack, false, nil); err != nil {
		t.Fatal(err)
	}
	st := newResendMemStore()
	var arr []audit.Arrival
	for i := range 5 {
		arr = append(arr, resendArrival(fmt.Sprintf("m-%d", i), tp.business, tp.key, nil, fmt.Sprint(i)))
	}
	_ = st.Write(context.Background(), arr, nil)
	r := newTestResender(t, st, tp)
	rep, err := r.Resend(context.Background(), audit.Filter{Exchange: tp.business}, audit.ResendOptions{Mode: audit.ResendToQueue, Queue: full, AllowAll: true}) // every message of the store
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, res := range rep.Results {
		got = append(got, res.MessageID+":"+res.Status)
		if res.Status == auditconst.StatusFailed && !strings.Contains(res.Error, "nack") {
			t.Errorf("%s: %q, want a nack", res.MessageID, res.Error)
		}
	}
	if want := "m-0:sent m-1:sent m-2:failed m-3:failed m-4:failed"; strings.Join(got, " ") != want || rep.Sent != 2 || rep.Failed != 3 {
		t.Fatalf("got %s, want %s (%+v)", strings.Join(got, " "), want, rep)
	}
	bodies := ""
	for _, d := range tp.drain(t, full, 2) {
		bodies += string(d.Body)
	}
	if bodies != "01" {
		t.Fatalf("queue holds %q, want the two oldest in order", bodies)
	}
}
