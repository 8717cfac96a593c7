package admin_test

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/poison/admin"
)

func newAdmin(t *testing.T, uri string) *admin.Admin {
	t.Helper()
	a, err := admin.New(admin.Config{URI: uri})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	return a
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func TestConfigValidate(t *testing.T) {
	for name, cfg := range map[string]admin.Config{
		"URI":              {},
		"URI is invalid":   {URI: "http://x"},
		"LoopBackExchange": {URI: "amqp://localhost/", LoopBackExchange: strings.Repeat("x", 256)},
	} {
		_, err := admin.New(cfg)
		if err == nil || !strings.Contains(err.Error(), "Config."+strings.Fields(name)[0]) {
			t.Errorf("%s: got %v, want an error naming the field", name, err)
		}
	}
}

func TestNewUnreachable(t *testing.T) {
	_, err := admin.New(admin.Config{URI: "amqp://guest:secret@127.0.0.1:1/"})
	if err == nil {
		t.Fatal("want an error")
	}
	if strings.Contains(err.Error(), "secret") {
		t.Errorf("error leaks the password: %v", err)
	}
}

func TestMessageFromDeliveryTolerant(t *testing.T) {
	d := amqp.Delivery{
		MessageId:   "mid",
		DeliveryTag: 7,
		Redelivered: true,
		Headers: amqp.Table{
			"rabbitretry-attempts":     "many",
			"rabbitretry-attempt":      int32(3),
			"rabbitretry-poisoned-at":  "yesterday",
			"rabbitretry-last-failure": time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC),
			"rabbitretry-error-class":  []byte("malformed"),
			"x-death":                  []any{amqp.Table{"count": int64(2), "queue": "q"}},
			"dec":                      amqp.Decimal{Scale: 2, Value: 12345},
			"flag":                     true,
			"nil":                      nil,
		},
	}
	m := admin.MessageFromDelivery(d)
	if m.UUID != "mid" {
		t.Errorf("UUID = %q, want the message-id fallback", m.UUID)
	}
	if m.Attempts != 3 {
		t.Errorf("Attempts = %d, want 3 (fallback to rabbitretry-attempt)", m.Attempts)
	}
	if !m.PoisonedAt.IsZero() {
		t.Errorf("PoisonedAt = %v, want zero", m.PoisonedAt)
	}
	if !m.LastFailure.Equal(time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)) {
		t.Errorf("LastFailure = %v", m.LastFailure)
	}
	if m.Class != "malformed" || m.DeliveryTag != 7 || !m.Redelivered {
		t.Errorf("got %+v", m)
	}
	for k, want := range map[string]string{
		"x-death": `[{"count":2,"queue":"q"}]`, "dec": "123.45", "flag": "true", "nil": "", "rabbitretry-attempt": "3",
	} {
		if got := m.Headers[k]; got != want {
			t.Errorf("Headers[%q] = %q, want %q", k, got, want)
		}
	}
	if z := admin.MessageFromDelivery(amqp.Delivery{}); z.UUID != "" || z.Attempts != 0 || z.Headers == nil {
		t.Errorf("empty delivery parsed as %+v", z)
	}
}

func TestFilterMatch(t *testing.T) {
	at := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	m := admin.Message{
		UUID: "u1", Reason: "db timeout after 5s", Handler: "h", OriginalQueue: "q", Class: "transient",
		PoisonedAt: at, Headers: map[string]string{"tenant": "acme"},
	}
	cases := []struct {
		f    admin.Filter
		want bool
	}{
		{admin.Filter{}, true},
		{admin.Filter{ReasonContains: "timeout"}, true},
		{admin.Filter{ReasonContains: "Timeout"}, false},
		{admin.Filter{ReasonRegexp: regexp.MustCompile(`after \d+s$`)}, true},
		{admin.Filter{ReasonRegexp: regexp.MustCompile(`^x`)}, false},
		{admin.Filter{Handler: "h", OriginalQueue: "q", Class: "transient"}, true},
		{admin.Filter{Class: "malformed"}, false},
		{admin.Filter{Since: at}, true},
		{admin.Filter{Since: at.Add(time.Nanosecond)}, false},
		{admin.Filter{Until: at}, false},
		{admin.Filter{Until: at.Add(time.Second)}, true},
		{admin.Filter{Headers: map[string]string{"tenant": "acme"}}, true},
		{admin.Filter{Headers: map[string]string{"tenant": "other"}}, false},
		{admin.Filter{Headers: map[string]string{"missing": ""}}, false},
		{admin.Filter{UUIDs: []string{"u0", "u1"}}, true},
		{admin.Filter{UUIDs: []string{"u0"}}, false},
		{admin.Filter{Limit: 1}, true},
	}
	for i, c := range cases {
		if got := admin.FilterMatch(c.f, m); got != c.want {
			t.Errorf("case %d %+v: Match = %v, want %v", i, c.f, got, c.want)
		}
	}
	if admin.FilterMatch(admin.Filter{Since: at}, admin.Message{}) {
		t.Error("a message without PoisonedAt matched a time filter")
	}
	if admin.FilterValidate(admin.Filter{Limit: -1}) == nil {
		t.Error("negative Limit accepted")
	}
}

func TestListLeavesQueueUnchanged(t *testing.T) {
	fx := newFixture(t)
	uuids := fx.publishPoisoned(t, 10, "permanent", "malformed")
	a := newAdmin(t, fx.uri)

	msgs, err := a.List(ctxT(t), fx.Poison, admin.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 10 {
		t.Fatalf("List returned %d messages, want 10", len(msgs))
	}
	m := msgs[3]
	if m.UUID != uuids[3] || string(m.Body) != `{"n":3}` || m.Reason != "handler failed: message 3 is bad" ||
		m.Class != "malformed" || m.Handler != "orders-handler" || m.Topic != fx.Q || m.Subscriber != "amqp-subscriber" ||
		m.OriginalQueue != fx.Q || m.OriginalExchange != fx.Business || m.OriginalRoutingKey != fx.Q ||
		m.Attempts != 5 || m.LastError == "" {
		t.Errorf("message parsed as %+v", m)
	}
	wantAt := time.Date(2024, 5, 1, 12, 0, 3, 0, time.UTC)
	if !m.PoisonedAt.Equal(wantAt) || !m.LastFailure.Equal(wantAt) || !m.FirstFailure.Equal(wantAt.Add(-time.Minute)) {
		t.Errorf("times: poisoned %v first %v last %v", m.PoisonedAt, m.FirstFailure, m.LastFailure)
	}
	if m.Headers["rabbitretry-attempts"] != "5" {
		t.Errorf("Headers = %v", m.Headers)
	}
	if d := fx.depth(t, fx.Poison); d != 10 {
		t.Fatalf("poison queue depth after List = %d, want 10", d)
	}

	// Second list: same messages, now flagged redelivered; filter + limit.
	msgs, err = a.List(ctxT(t), fx.Poison, admin.Filter{Class: "malformed", Limit: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 2 || msgs[0].Class != "malformed" || !msgs[0].Redelivered {
		t.Fatalf("filtered list = %+v", msgs)
	}
	if d := fx.depth(t, fx.Poison); d != 10 {
		t.Fatalf("poison queue depth after second List = %d, want 10", d)
	}
}

func TestListMissingQueue(t *testing.T) {
	uri := brokerURI(t)
	a := newAdmin(t, uri)
	q := uniqueName(t, "admintest.missing")
	_, err := a.List(ctxT(t), q, admin.Filter{})
	if !errors.Is(err, admin.ErrQueueNotFound) || !strings.Contains(err.Error(), q) || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("err = %v, want ErrQueueNotFound naming %q", err, q)
	}
	// The admin is still usable after the 404 closed that channel.
	if _, err := a.Stats(ctxT(t), q); !errors.Is(err, admin.ErrQueueNotFound) {
		t.Fatalf("Stats err = %v", err)
	}
	if _, err := a.Purge(ctxT(t), q, admin.Filter{}, false); !errors.Is(err, admin.ErrQueueNotFound) {
		t.Fatalf("Purge err = %v", err)
	}
}

func TestReplay500(t *testing.T) {
	fx := newFixture(t)
	const n = 500
	uuids := fx.publishPoisoned(t, n)
	a := newAdmin(t, fx.uri)

	var progress []int
	res, err := a.Replay(ctxT(t), fx.Poison, admin.Filter{}, admin.ReplayOptions{
		Progress: func(done, total int) {
			if total != n {
				t.Errorf("Progress total = %d", total)
			}
			progress = append(progress, done)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Matched != n || res.Replayed != n || res.Skipped != 0 || len(res.Errors) != 0 || len(res.Duplicated) != 0 {
		t.Fatalf("result = %+v", res)
	}
	if len(progress) != n || progress[n-1] != n {
		t.Errorf("Progress called %d times, last %v", len(progress), progress[len(progress)-1:])
	}
	if d := fx.depth(t, fx.Poison); d != 0 {
		t.Errorf("poison queue depth after replay = %d, want 0", d)
	}
	if got := fx.drain(t, fx.Q2); len(got) != 0 {
		t.Errorf("%d messages reached Q2, want none", len(got))
	}
	seen := map[string]int{}
	for _, d := range fx.drain(t, fx.Q) {
		seen[uuidOf(d)]++
		if _, ok := d.Headers["rabbitretry-replayed"]; !ok {
			t.Fatalf("replayed message lacks rabbitretry-replayed: %v", d.Headers)
		}
		for _, k := range []string{"rabbitretry-attempt", "reason_poisoned", "topic_poisoned", "handler_poisoned",
			"subscriber_poisoned", "rabbitretry-attempts", "rabbitretry-poisoned-at"} {
			if _, ok := d.Headers[k]; ok {
				t.Fatalf("replayed message still has %s", k)
			}
		}
		for _, k := range []string{"rabbitretry-first-failure", "rabbitretry-last-error", "rabbitretry-error-class", "rabbitretry-original-queue"} {
			if _, ok := d.Headers[k]; !ok {
				t.Fatalf("replayed message lost %s", k)
			}
		}
		if ts, err := time.Parse(time.RFC3339, d.Headers["rabbitretry-replayed"].(string)); err != nil || time.Since(ts) > time.Minute {
			t.Fatalf("rabbitretry-replayed = %v", d.Headers["rabbitretry-replayed"])
		}
		if d.ContentType != "application/json" || d.DeliveryMode != amqp.Persistent {
			t.Fatalf("properties lost: %+v", d)
		}
	}
	for _, u := range uuids {
		if seen[u] != 1 {
			t.Fatalf("UUID %s reached Q %d times, want exactly once", u, seen[u])
		}
	}
	if len(seen) != n {
		t.Fatalf("Q received %d distinct UUIDs, want %d", len(seen), n)
	}
}

func TestReplayInterruptedLosesNothing(t *testing.T) {
	fx := newFixture(t)
	const n = 500
	uuids := fx.publishPoisoned(t, n)
	a := newAdmin(t, fx.uri)

	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	res, err := a.Replay(ctx, fx.Poison, admin.Filter{}, admin.ReplayOptions{
		Progress: func(done, total int) {
			if done == 250 {
				cancel()
			}
		},
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	t.Logf("result: %+v, err: %v", res, err)

	inQ := map[string]int{}
	for _, d := range fx.drain(t, fx.Q) {
		inQ[uuidOf(d)]++
	}
	inPoison := map[string]int{}
	for _, d := range fx.drain(t, fx.Poison) {
		inPoison[uuidOf(d)]++
	}
	dups := 0
	for _, u := range uuids {
		switch {
		case inQ[u] == 0 && inPoison[u] == 0:
			t.Fatalf("message %s lost", u)
		case inQ[u]+inPoison[u] > 1:
			dups++
		}
	}
	t.Logf("replayed to Q: %d, left in poison queue: %d, duplicates: %d (reported: %v)", len(inQ), len(inPoison), dups, res.Duplicated)
	if res.Replayed != len(inQ) {
		t.Errorf("Replayed = %d but Q holds %d", res.Replayed, len(inQ))
	}
	if res.Replayed < 250 || res.Replayed >= n {
		t.Errorf("Replayed = %d, want a partial replay stopping around 250", res.Replayed)
	}
	if dups > len(res.Duplicated) {
		t.Errorf("%d duplicates, only %d reported", dups, len(res.Duplicated))
	}
}

func TestReplayDryRunSkipAndUnroutable(t *testing.T) {
	fx := newFixture(t)
	fx.publishPoisoned(t, 3)
	// One message without original queue, one whose original queue is not
	// bound to the loop-back exchange.
	unbound := fx.Q2
	fx.publish(t, fx.Poison, []amqp.Publishing{
		{Headers: amqp.Table{"_watermill_message_uuid": "no-origin", "reason_poisoned": "x"}, Body: []byte("a")},
		{Headers: amqp.Table{"_watermill_message_uuid": "unbound", "rabbitretry-original-queue": unbound}, Body: []byte("b")},
	})
	a := newAdmin(t, fx.uri)

	res, err := a.Replay(ctxT(t), fx.Poison, admin.Filter{}, admin.ReplayOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Matched != 5 || res.Replayed != 4 || res.Skipped != 1 || len(res.Errors) != 1 || !errors.Is(res.Errors[0], admin.ErrNoOriginalQueue) {
		t.Fatalf("dry run result = %+v", res)
	}
	if d := fx.depth(t, fx.Poison); d != 5 {
		t.Fatalf("dry run changed the poison queue: depth %d", d)
	}
	if d := fx.depth(t, fx.Q); d != 0 {
		t.Fatalf("dry run published: Q depth %d", d)
	}

	res, err = a.Replay(ctxT(t), fx.Poison, admin.Filter{}, admin.ReplayOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Matched != 5 || res.Replayed != 3 || res.Skipped != 1 || len(res.Errors) != 2 {
		t.Fatalf("result = %+v", res)
	}
	var unroutable bool
	for _, e := range res.Errors {
		var me *admin.MessageError
		if errors.As(e, &me) && me.UUID == "unbound" && errors.Is(e, confirm.ErrUnroutable) {
			unroutable = true
		}
	}
	if !unroutable {
		t.Errorf("errors %v lack the unroutable message", res.Errors)
	}
	left := fx.drain(t, fx.Poison)
	if len(left) != 2 {
		t.Fatalf("%d messages left in the poison queue, want 2", len(left))
	}
	if got := fx.drain(t, fx.Q); len(got) != 3 {
		t.Fatalf("Q got %d messages, want 3", len(got))
	}

	// DefaultQueue sends the header-less one to Q.
	fx.publish(t, fx.Poison, []amqp.Publishing{{Headers: amqp.Table{"_watermill_message_uuid": "no-origin"}, Body: []byte("a")}})
	res, err = a.Replay(ctxT(t), fx.Poison, admin.Filter{UUIDs: []string{"no-origin"}}, admin.ReplayOptions{DefaultQueue: fx.Q})
	if err != nil || res.Replayed != 1 {
		t.Fatalf("DefaultQueue replay: %+v, %v", res, err)
	}
	if got := fx.drain(t, fx.Q); len(got) != 1 || uuidOf(got[0]) != "no-origin" {
		t.Fatalf("Q got %v", got)
	}
}

func TestReplayMissingLoopBackExchange(t *testing.T) {
	fx := newFixture(t)
	fx.publishPoisoned(t, 2)
	a, err := admin.New(admin.Config{URI: fx.uri, LoopBackExchange: uniqueName(t, "admintest.noexchange")})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	_, err = a.Replay(ctxT(t), fx.Poison, admin.Filter{}, admin.ReplayOptions{})
	if !errors.Is(err, admin.ErrExchangeNotFound) {
		t.Fatalf("err = %v, want ErrExchangeNotFound", err)
	}
	if d := fx.depth(t, fx.Poison); d != 2 {
		t.Fatalf("poison depth %d, want 2", d)
	}
}

func TestPurgeWithFilter(t *testing.T) {
	fx := newFixture(t)
	fx.publishPoisoned(t, 9, "permanent", "malformed", "exhausted")
	a := newAdmin(t, fx.uri)

	n, err := a.Purge(ctxT(t), fx.Poison, admin.Filter{Class: "malformed"}, true)
	if err != nil || n != 3 {
		t.Fatalf("dry-run purge = %d, %v", n, err)
	}
	if d := fx.depth(t, fx.Poison); d != 9 {
		t.Fatalf("dry run removed messages: depth %d", d)
	}
	n, err = a.Purge(ctxT(t), fx.Poison, admin.Filter{Class: "malformed"}, false)
	if err != nil || n != 3 {
		t.Fatalf("purge = %d, %v", n, err)
	}
	left := fx.drain(t, fx.Poison)
	if len(left) != 6 {
		t.Fatalf("%d messages left, want 6", len(left))
	}
	for _, d := range left {
		if d.Headers["rabbitretry-error-class"] == "malformed" {
			t.Fatalf("a malformed message survived the purge")
		}
	}
}

func TestMove(t *testing.T) {
	fx := newFixture(t)
	uuids := fx.publishPoisoned(t, 6, "permanent", "malformed")
	a := newAdmin(t, fx.uri)

	if _, err := a.Move(ctxT(t), fx.Poison, uniqueName(t, "admintest.missing"), admin.Filter{}, false); !errors.Is(err, admin.ErrQueueNotFound) {
		t.Fatalf("move to a missing queue: %v", err)
	}
	n, err := a.Move(ctxT(t), fx.Poison, fx.Q2, admin.Filter{Class: "permanent"}, true)
	if err != nil || n != 3 || fx.depth(t, fx.Q2) != 0 {
		t.Fatalf("dry-run move = %d, %v", n, err)
	}
	n, err = a.Move(ctxT(t), fx.Poison, fx.Q2, admin.Filter{Class: "permanent"}, false)
	if err != nil || n != 3 {
		t.Fatalf("move = %d, %v", n, err)
	}
	moved := fx.drain(t, fx.Q2)
	if len(moved) != 3 {
		t.Fatalf("Q2 holds %d messages, want 3", len(moved))
	}
	for i, d := range moved {
		if uuidOf(d) != uuids[2*i] || d.Headers["reason_poisoned"] == nil || d.Headers["rabbitretry-error-class"] != "permanent" {
			t.Fatalf("moved message %d: %v", i, d.Headers)
		}
	}
	if d := fx.depth(t, fx.Poison); d != 3 {
		t.Fatalf("poison queue depth %d, want 3", d)
	}
}

func TestStats(t *testing.T) {
	fx := newFixture(t)
	fx.publishPoisoned(t, 6, "permanent", "malformed", "malformed")
	fx.publish(t, fx.Poison, []amqp.Publishing{{Body: []byte("bare")}})
	a := newAdmin(t, fx.uri)

	st, err := a.Stats(ctxT(t), fx.Poison)
	if err != nil {
		t.Fatal(err)
	}
	if st.Depth != 7 || st.Scanned != 7 || st.ByClass["malformed"] != 4 || st.ByClass["permanent"] != 2 || st.ByClass[""] != 1 ||
		st.ByHandler["orders-handler"] != 6 || st.ByOriginalQueue[fx.Q] != 6 {
		t.Fatalf("stats = %+v", st)
	}
	base := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	if !st.Oldest.Equal(base) || !st.Newest.Equal(base.Add(5*time.Second)) {
		t.Fatalf("oldest %v newest %v", st.Oldest, st.Newest)
	}
	if d := fx.depth(t, fx.Poison); d != 7 {
		t.Fatalf("Stats changed the queue: depth %d", d)
	}
}

func TestClosed(t *testing.T) {
	a := newAdmin(t, brokerURI(t))
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if _, err := a.List(context.Background(), "q", admin.Filter{}); !errors.Is(err, middleware.ErrClosed) {
		t.Fatalf("List after Close: %v", err)
	}
}

func TestQuorumPoisonQueue(t *testing.T) {
	fx := newFixture(t)
	qq := fx.Q + ".qq.poison"
	ch, err := fx.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(qq, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Skipf("quorum queues unavailable: %v", err)
	}
	t.Cleanup(func() {
		if c, err := fx.conn.Channel(); err == nil {
			_, _ = c.QueueDelete(qq, false, false, false)
			_ = c.Close()
		}
	})
	fx.publish(t, qq, []amqp.Publishing{
		{Headers: fx.poisonHeaders(0, "qq-0", "permanent", time.Now()), Body: []byte("0")},
		{Headers: fx.poisonHeaders(1, "qq-1", "malformed", time.Now()), Body: []byte("1")},
	})
	a := newAdmin(t, fx.uri)
	for range 2 {
		msgs, err := a.List(ctxT(t), qq, admin.Filter{})
		if err != nil || len(msgs) != 2 {
			t.Fatalf("List = %d messages, %v", len(msgs), err)
		}
	}
	msgs, err := a.List(ctxT(t), qq, admin.Filter{UUIDs: []string{"qq-1"}})
	if err != nil || len(msgs) != 1 {
		t.Fatalf("List = %v, %v", msgs, err)
	}
	t.Logf("x-delivery-count after two lists: %q", msgs[0].Headers["x-delivery-count"])
	res, err := a.Replay(ctxT(t), qq, admin.Filter{Class: "malformed"}, admin.ReplayOptions{})
	if err != nil || res.Replayed != 1 {
		t.Fatalf("Replay = %+v, %v", res, err)
	}
	got := fx.drain(t, fx.Q)
	if len(got) != 1 || uuidOf(got[0]) != "qq-1" {
		t.Fatalf("Q got %d messages", len(got))
	}
	if _, ok := got[0].Headers["x-delivery-count"]; ok {
		t.Errorf("replayed copy carries x-delivery-count")
	}
	if d := fx.depth(t, qq); d != 1 {
		t.Fatalf("quorum poison queue depth %d, want 1", d)
	}
}
