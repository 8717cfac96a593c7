package faults

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// pad extends s with 'x' to exactly n bytes.
func pad(s string, n int) string {
	if len(s) > n {
		panic(fmt.Sprintf("%q longer than %d", s, n))
	}
	return s + strings.Repeat("x", n-len(s))
}

// threeMessages: "ok" succeeds at once, "retry" fails once then succeeds,
// "perm" fails permanently (poisoned at once).
func threeMessages(t *testing.T, e *env) {
	t.Helper()
	l := newLedger()
	uuids, ps := newMessages(3, func(i int) []byte { return []byte([]string{"ok", "retry", "perm"}[i]) })
	e.start(func(msg *message.Message) error {
		a := middleware.Attempt(msg)
		l.attempt(msg.UUID, a)
		switch string(msg.Payload) {
		case "retry":
			if a == 1 {
				return errTransient
			}
		case "perm":
			return middleware.Permanent(errors.New("bad order"))
		}
		l.success(msg.UUID)
		return nil
	})
	e.publish(ps...)
	settled := e.settle(3, l.handled, 20*time.Second)
	e.stop()
	poisoned, _ := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	if acc.Handled != 2 || acc.Poisoned != 1 {
		t.Errorf("handled %d poisoned %d, want 2 and 1", acc.Handled, acc.Poisoned)
	}
	if got := l.attemptsOf(uuids[1]); fmt.Sprint(got) != "[1 2]" {
		t.Errorf("retried message attempts %v, want [1 2]", got)
	}
}

// Queue names with dots, spaces, non-ASCII and at the length limit work end
// to end; a name whose derived wait-queue name exceeds 255 bytes is refused
// before anything is declared, with an error naming the queue.
func TestBadInputQueueNames(t *testing.T) {
	// The longest wait-queue suffix is ".wait.400ms" (11 bytes).
	longest := 255 - len(".wait.400ms")
	cases := []struct {
		name    string
		queue   func(prefix string) string
		tooLong bool
	}{
		{"dots", func(p string) string { return p + ".a.b..c." }, false},
		{"spaces", func(p string) string { return p + " with  spaces " }, false},
		{"unicode", func(p string) string { return p + ".zürich-東京" }, false},
		{"longest-that-fits", func(p string) string { return pad(p+".", longest) }, false},
		{"one-byte-too-long", func(p string) string { return pad(p+".", longest+1) }, true},
		{"255-bytes", func(p string) string { return pad(p+".", 255) }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, "classic", func(e *env, _ *amqpretry.Config) { e.queue = c.queue(e.prefix) })
			if !c.tooLong {
				e.declare()
				threeMessages(t, e)
				return
			}
			sub, err := wamqp.NewSubscriber(e.retry.SubscriberConfig(), watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			_, err = sub.Subscribe(ctx, e.queue)
			if err == nil {
				t.Fatalf("Subscribe(%d-byte queue) succeeded", len(e.queue))
			}
			t.Logf("error: %v", err)
			if !strings.Contains(err.Error(), e.queue[:50]) || !strings.Contains(err.Error(), "more than RabbitMQ's 255") {
				t.Errorf("error does not name the queue and the limit: %v", err)
			}
			if d := e.depth(e.queue); d != -1 {
				t.Errorf("the originating queue was declared anyway")
			}
			if err := e.retry.Topology().CheckNames(e.queue); err == nil {
				t.Errorf("CheckNames accepted it")
			}
		})
	}
}

// Bad Config values are refused by New (Config.Validate) with an error
// naming the field; MaxAttempts 0 takes the default 5.
func TestBadInputConfig(t *testing.T) {
	uri := brokerURI(t)
	base := func() amqpretry.Config {
		sc := wamqp.NewDurableQueueConfig(uri)
		return amqpretry.Config{URI: uri, Subscriber: sc, Mode: amqpretry.Tiers(time.Second)}
	}
	manyTiers := make([]time.Duration, amqpretry.MaxTiers+1)
	for i := range manyTiers {
		manyTiers[i] = time.Duration(i+1) * time.Second
	}
	cases := []struct {
		name    string
		mod     func(c *amqpretry.Config)
		wantErr string // "" = valid
	}{
		{"tier zero", func(c *amqpretry.Config) { c.Mode = amqpretry.Tiers(0) }, "Tiers[0]"},
		{"tier negative", func(c *amqpretry.Config) { c.Mode = amqpretry.Tiers(time.Second, -time.Second) }, "Tiers[1]"},
		{"tier above MaxTTL", func(c *amqpretry.Config) {
			c.Mode = amqpretry.Tiers(amqpretry.MaxTTL + time.Millisecond)
		}, "Tiers[0]"},
		{"tier not whole ms", func(c *amqpretry.Config) {
			c.Mode = amqpretry.Tiers(time.Second, 1500*time.Microsecond)
		}, "Tiers[1]"},
		{"tier at MaxTTL", func(c *amqpretry.Config) { c.Mode = amqpretry.Tiers(amqpretry.MaxTTL) }, ""},
		{"too many tiers", func(c *amqpretry.Config) { c.Mode = amqpretry.Tiers(manyTiers...) }, "Tiers has 33 tiers"},
		{"MaxAttempts negative", func(c *amqpretry.Config) { c.MaxAttempts = -1 }, "MaxAttempts -1"},
		{"MaxAttempts above cap", func(c *amqpretry.Config) { c.MaxAttempts = middleware.MaxAttemptsCap + 1 }, "MaxAttempts 1001"},
		{"MaxAttempts 1", func(c *amqpretry.Config) { c.MaxAttempts = 1; c.Mode = nil }, ""},
		{"queue type", func(c *amqpretry.Config) { c.QueueType = "stream" }, `QueueType "stream"`},
		{"user DLX", func(c *amqpretry.Config) {
			c.Subscriber.Queue.Arguments = amqp.Table{"x-dead-letter-exchange": "mine"}
		}, "x-dead-letter-exchange"},
		{"negative channels", func(c *amqpretry.Config) { c.PublisherChannels = -1 }, "PublisherChannels -1"},
		{"negative confirm timeout", func(c *amqpretry.Config) { c.ConfirmTimeout = -time.Second }, "ConfirmTimeout"},
		{"no URI", func(c *amqpretry.Config) { c.URI = ""; c.Subscriber.Connection.AmqpURI = "" }, "URI is empty"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := base()
			c.mod(&cfg)
			r, err := amqpretry.New(cfg)
			if c.wantErr == "" {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				_ = r.Close()
				return
			}
			if err == nil {
				_ = r.Close()
				t.Fatalf("New accepted it, want an error naming %q", c.wantErr)
			}
			if !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("error %q does not name %q", err, c.wantErr)
			}
		})
	}
	t.Run("MaxAttempts 0 is the default 5", func(t *testing.T) {
		cfg := base()
		cfg.MaxAttempts = 0
		r, err := amqpretry.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if got := r.Chain().Republisher.MaxAttempts(); got != 5 {
			t.Errorf("MaxAttempts %d, want 5", got)
		}
	})
}

// Messages without the Watermill UUID header are handled, retried and
// poisoned. Without a UUID header the amqpretry Marshaler uses the AMQP
// message-id property as the UUID; with neither, it generates a UUID on the
// first delivery, which the retry copy and the poison copy carry: the same
// UUID on every attempt, a different one for each message. A non-string UUID
// header becomes its string form.
func TestBadInputNoUUID(t *testing.T) {
	e := newEnv(t, "classic")
	e.declare()
	var mu sync.Mutex
	seen := map[string][]string{} // payload -> UUIDs per attempt
	handled := map[string]int{}
	e.start(func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		seen[string(msg.Payload)] = append(seen[string(msg.Payload)], msg.UUID)
		if middleware.Attempt(msg) == 1 {
			return errTransient
		}
		if strings.HasPrefix(string(msg.Payload), "poison") {
			return middleware.Permanent(errors.New("rejected"))
		}
		handled[string(msg.Payload)]++
		return nil
	})
	msgID := "msgid-" + e.prefix
	ps := []amqp.Publishing{
		{Body: []byte("poison-no-id"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"order-id": "42"}},
		{Body: []byte("poison-message-id"), DeliveryMode: amqp.Persistent, MessageId: msgID},
		{Body: []byte("handled-no-id"), DeliveryMode: amqp.Persistent},
		{Body: []byte("handled-int-uuid"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: int64(42)}},
	}
	e.publish(ps...)
	keys := []string{"poison-no-id", "poison-message-id", "handled-no-id", "handled-int-uuid"}
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(handled)
	}
	settled := e.settle(len(keys), count, 20*time.Second)
	e.stop()
	_, ds := e.poisoned()
	poisonedByPayload := map[string]int{}
	for _, d := range ds {
		poisonedByPayload[string(d.Body)]++
		t.Logf("poison copy of %q: uuid header %q, message-id property %q, order-id %q, original queue %q",
			d.Body, d.Headers[wamqp.DefaultMessageUUIDHeaderKey], d.MessageId, d.Headers["order-id"], d.Headers[middleware.OriginalQueueKey])
		if d.Headers[middleware.OriginalQueueKey] != e.queue {
			t.Errorf("poison copy of %q does not name its original queue", d.Body)
		}
	}
	mu.Lock()
	account(t, keys, cloneMap(handled), poisonedByPayload) // keyed by payload: there is no usable UUID
	for _, k := range keys {
		t.Logf("%s: UUIDs seen per attempt %q", k, seen[k])
	}
	want := map[string]string{"poison-no-id": "", "poison-message-id": msgID, "handled-no-id": "", "handled-int-uuid": "42"}
	for k, u := range want {
		if u == "" && len(seen[k]) > 0 { // generated: any UUID, the same on both attempts
			u = seen[k][0]
			if len(u) != 36 {
				t.Errorf("%s: UUID %q, want a generated one", k, u)
			}
		}
		if len(seen[k]) != 2 || seen[k][0] != u || seen[k][1] != u {
			t.Errorf("%s: UUIDs %q, want %q on both attempts", k, seen[k], u)
		}
	}
	if len(seen["poison-no-id"]) > 0 && len(seen["handled-no-id"]) > 0 && seen["poison-no-id"][0] == seen["handled-no-id"][0] {
		t.Errorf("two messages without identity share the UUID %q", seen["poison-no-id"][0])
	}
	mu.Unlock()
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	for _, d := range ds {
		if string(d.Body) == "poison-no-id" && d.Headers["order-id"] != "42" {
			t.Errorf("poison copy without UUID lost its identifying header: %v", d.Headers)
		}
		if string(d.Body) == "poison-no-id" && (len(seen["poison-no-id"]) == 0 || d.Headers[wamqp.DefaultMessageUUIDHeaderKey] != seen["poison-no-id"][0]) {
			t.Errorf("poison copy of a message without identity does not carry the UUID its attempts had: %v", d.Headers)
		}
		if string(d.Body) == "poison-message-id" && d.Headers[wamqp.DefaultMessageUUIDHeaderKey] != msgID {
			t.Errorf("poison copy of a message-id message does not carry it as UUID: %v", d.Headers)
		}
	}
}

// Headers of every AMQP field type reach the handler as strings (the
// amqpretry Marshaler converts them) on the first delivery and, unchanged,
// on the retry copy.
func TestBadInputNonStringHeaders(t *testing.T) {
	e := newEnv(t, "classic")
	e.declare()
	ts := time.Date(2024, 2, 29, 12, 30, 45, 0, time.UTC)
	headers := amqp.Table{
		"h-bool":      true,
		"h-int8":      int8(-8),
		"h-int16":     int16(-1600),
		"h-uint16":    uint16(1600),
		"h-int32":     int32(-320000),
		"h-uint32":    uint32(320000),
		"h-int64":     int64(1) << 40,
		"h-float32":   float32(1.5),
		"h-float64":   float64(-2.25),
		"h-decimal":   amqp.Decimal{Scale: 2, Value: 12345},
		"h-timestamp": ts,
		"h-bytes":     []byte("raw\x00\xffbytes"),
		"h-table":     amqp.Table{"k": "v", "n": int32(1), "nested": amqp.Table{"b": false}},
		"h-array":     []any{"a", int32(1), true, []any{"x"}},
		"h-void":      nil,
		"h-string":    "plain",
	}
	uuids, ps := newMessages(1, nil)
	for k, v := range headers {
		ps[0].Headers[k] = v
	}
	l := newLedger()
	var mu sync.Mutex
	var metas []message.Metadata
	e.start(func(msg *message.Message) error {
		a := middleware.Attempt(msg)
		l.attempt(msg.UUID, a)
		mu.Lock()
		metas = append(metas, maps.Clone(msg.Metadata))
		mu.Unlock()
		if a == 1 {
			return errTransient
		}
		l.success(msg.UUID)
		return nil
	})
	e.publish(ps...)
	settled := e.settle(1, l.handled, 20*time.Second)
	e.stop()
	poisoned, _ := e.poisoned()
	account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Fatalf("did not settle")
	}
	e.checkEmpty()
	mu.Lock()
	defer mu.Unlock()
	if len(metas) != 2 {
		t.Fatalf("%d attempts, want 2", len(metas))
	}
	for _, k := range slices.Sorted(maps.Keys(headers)) {
		v1, ok1 := metas[0][k]
		v2, ok2 := metas[1][k]
		t.Logf("%-12s %-16T -> %q", k, headers[k], v1)
		if !ok1 || !ok2 {
			t.Errorf("%s: present on attempt 1: %v, on the retry: %v", k, ok1, ok2)
		} else if v1 != v2 {
			t.Errorf("%s: %q on attempt 1, %q on the retry", k, v1, v2)
		}
	}
	if p := metas[0][retrymeta.HeaderErrorKey]; p != "" {
		t.Errorf("header problems reported: %s", p)
	}
}

// A 10 MB payload is retried and poisoned byte for byte intact.
func TestBadInputBigPayload(t *testing.T) {
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) { c.MaxAttempts = 3 })
	e.declare()
	payload := make([]byte, 10<<20)
	if _, err := rand.Read(payload); err != nil {
		t.Fatal(err)
	}
	want := sha256.Sum256(payload)
	uuids, ps := newMessages(1, func(int) []byte { return payload })
	l := newLedger()
	var mu sync.Mutex
	var sums [][32]byte
	e.start(func(msg *message.Message) error {
		l.attempt(msg.UUID, middleware.Attempt(msg))
		mu.Lock()
		sums = append(sums, sha256.Sum256(msg.Payload))
		mu.Unlock()
		return errTransient
	})
	e.publish(ps...)
	settled := e.settle(1, l.handled, 60*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Fatalf("did not settle")
	}
	e.checkEmpty()
	mu.Lock()
	defer mu.Unlock()
	if len(sums) != 3 {
		t.Errorf("%d attempts, want 3", len(sums))
	}
	for i, s := range sums {
		if s != want {
			t.Errorf("attempt %d saw a different payload", i+1)
		}
	}
	if len(ds) != 1 || sha256.Sum256(ds[0].Body) != want || !bytes.Equal(ds[0].Body[:64], payload[:64]) {
		t.Fatalf("poison copy differs from the published 10 MB payload")
	}
	t.Logf("10 MB payload: %d attempts and the poison copy all have sha256 %x", len(sums), want[:8])
}

// A queue that already exists with other arguments: the broker refuses the
// declare (PRECONDITION_FAILED) and Subscribe fails with an error naming the
// queue and the conflicting argument, reachable as *amqpretry.DeclareError
// through watermill-amqp's wrapping.
func TestBadInputDeclareConflict(t *testing.T) {
	e := newEnv(t, "classic")
	ch := e.admin.channel()
	if _, err := ch.QueueDeclare(e.queue, true, false, false, false, amqp.Table{"x-message-ttl": int32(1234)}); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()
	sub, err := wamqp.NewSubscriber(e.retry.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	_, err = sub.Subscribe(context.Background(), e.queue)
	if err == nil {
		t.Fatal("Subscribe succeeded on a conflicting queue")
	}
	t.Logf("Subscribe error: %v", err)
	var de *amqpretry.DeclareError
	if !errors.As(err, &de) {
		t.Fatalf("no *amqpretry.DeclareError in %T: %v", err, err)
	}
	var aerr *amqp.Error
	if !errors.As(err, &aerr) || aerr.Code != amqp.PreconditionFailed {
		t.Errorf("no 406 *amqp.Error in the chain")
	}
	if de.Kind != "queue" || de.Name != e.queue || de.Argument == "" {
		t.Errorf("DeclareError %+v: want kind queue, name %q and the argument", de, e.queue)
	}
	if !strings.Contains(err.Error(), e.queue) || !strings.Contains(err.Error(), de.Argument) {
		t.Errorf("error text does not name the queue and the argument")
	}
	t.Logf("the broker reported argument %q (the queue has x-message-ttl=1234 and no dead-letter arguments)", de.Argument)
}

// A user without configure permission: New succeeds (it only connects), the
// subscriber's declare is refused with ACCESS_REFUSED, reported as an error
// (no panic, no hang).
func TestBadInputAccessRefused(t *testing.T) {
	haveRabbitmqctl(t)
	uri := brokerURI(t)
	user := "rr_restricted_" + strings.ToLower(watermill.NewShortUUID()[:8])
	const pass = "pw-restricted"
	if _, err := rabbitmqctl(t, 30*time.Second, "-q", "add_user", user, pass); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = rabbitmqctl(t, 30*time.Second, "-q", "delete_user", user) })
	if _, err := rabbitmqctl(t, 30*time.Second, "-q", "set_permissions", "-p", "/", user, "^$", "^$", "^$"); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(uri)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(user, pass)
	restricted := u.String()

	prefix := uniquePrefix(t)
	sc := wamqp.NewDurableQueueConfig(restricted)
	sc.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return prefix + ".biz" }, Type: "direct", Durable: true}
	r, err := amqpretry.New(amqpretry.Config{URI: restricted, Subscriber: sc, Naming: uniqueNaming(prefix)})
	if err != nil {
		t.Fatalf("New with a restricted user: %v", err)
	}
	defer r.Close()
	sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("NewSubscriber: %v", err)
	}
	defer sub.Close()
	_, err = sub.Subscribe(context.Background(), prefix+".q")
	if err == nil {
		t.Fatal("Subscribe succeeded without configure permission")
	}
	t.Logf("Subscribe error: %v", err)
	var aerr *amqp.Error
	if !errors.As(err, &aerr) || aerr.Code != amqp.AccessRefused {
		t.Errorf("want a 403 ACCESS_REFUSED *amqp.Error in the chain, got %v", err)
	}
	var de *amqpretry.DeclareError
	if !errors.As(err, &de) || de.Name != prefix+".q" {
		t.Errorf("want a *amqpretry.DeclareError naming the queue")
	}
	if !strings.Contains(err.Error(), "ACCESS_REFUSED") {
		t.Errorf("error text lacks ACCESS_REFUSED")
	}
	// The retry publisher of that user cannot publish to the (missing,
	// forbidden) wait exchange either: an error, not a panic.
	perr := r.Publisher().PublishRaw(context.Background(), prefix+".wait", "x", amqp.Publishing{Body: []byte("x")})
	if perr == nil {
		t.Errorf("publish to a forbidden exchange succeeded")
	}
	t.Logf("publish error: %v", perr)
}

// AMQP basic properties of the original delivery survive the retry and
// poison copies: amqpretry.Marshaler records them in metadata on Unmarshal and
// restores them on Marshal. Expiration is deliberately not carried (a
// per-message TTL would cut the wait in a wait queue short).
func TestBadInputAMQPProperties(t *testing.T) {
	e := newEnv(t, "classic")
	e.declare()
	uuids, ps := newMessages(1, nil)
	p := ps[0]
	p.ContentType, p.ContentEncoding, p.CorrelationId, p.MessageId = "application/json", "identity", "corr-1", "msg-1"
	p.Priority, p.Timestamp, p.Type, p.AppId, p.ReplyTo = 5, time.Unix(1700000000, 0), "order.created", "shop", "replies"
	p.Expiration = "600000"
	p.Headers["user-key"] = "kept"
	l := newLedger()
	e.start(func(msg *message.Message) error {
		a := middleware.Attempt(msg)
		l.attempt(msg.UUID, a)
		if a == 1 {
			return errTransient
		}
		return middleware.Permanent(errors.New("rejected"))
	})
	e.publish(p)
	settled := e.settle(1, l.handled, 20*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	account(t, uuids, l.successes(), poisoned)
	if !settled || len(ds) != 1 {
		t.Fatal("not poisoned")
	}
	d := ds[0]
	if d.DeliveryMode != amqp.Persistent {
		t.Errorf("poison copy delivery mode %d, want persistent", d.DeliveryMode)
	}
	if string(d.Body) != string(p.Body) || d.Headers["user-key"] != "kept" {
		t.Errorf("poison copy body or user header changed")
	}
	props := []struct {
		name      string
		orig, got any
	}{
		{"content-type", p.ContentType, d.ContentType}, {"content-encoding", p.ContentEncoding, d.ContentEncoding},
		{"correlation-id", p.CorrelationId, d.CorrelationId}, {"message-id", p.MessageId, d.MessageId},
		{"priority", p.Priority, d.Priority}, {"timestamp", p.Timestamp.Unix(), d.Timestamp.Unix()},
		{"type", p.Type, d.Type}, {"app-id", p.AppId, d.AppId}, {"reply-to", p.ReplyTo, d.ReplyTo},
		{"expiration", p.Expiration, d.Expiration},
	}
	var dropped []string
	for _, pr := range props {
		if fmt.Sprint(pr.orig) != fmt.Sprint(pr.got) {
			dropped = append(dropped, fmt.Sprintf("%s (%v -> %v)", pr.name, pr.orig, pr.got))
		}
	}
	if fmt.Sprint(dropped) != "[expiration (600000 -> )]" {
		t.Errorf("AMQP properties not carried to the poison copy: %v (want only expiration dropped)", dropped)
	}
}
