package middleware_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/internal/wire"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

var pfFixedNow = time.Date(2025, 6, 7, 8, 9, 10, 123456789, time.UTC)

// pfRecordingPublisher records published messages, or fails with err.
type pfRecordingPublisher struct {
	mu     sync.Mutex
	topics []string
	msgs   []*message.Message
	err    error
}

func (p *pfRecordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	for _, m := range msgs {
		p.topics = append(p.topics, topic)
		p.msgs = append(p.msgs, m)
	}
	return nil
}

func (p *pfRecordingPublisher) Close() error { return nil }

func (p *pfRecordingPublisher) published() ([]string, []*message.Message) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.topics...), append([]*message.Message(nil), p.msgs...)
}

type observed struct {
	uuid    string
	attempt int
	class   string
	err     error
}

type pfRecObserver struct {
	middleware.NopObserver
	mu           sync.Mutex
	poisoned     []observed
	poisonFailed []observed
}

func (o *pfRecObserver) Poisoned(msg *message.Message, attempt int, class string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.poisoned = append(o.poisoned, observed{uuid: msg.UUID, attempt: attempt, class: class})
}

func (o *pfRecObserver) PoisonFailed(msg *message.Message, attempt int, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.poisonFailed = append(o.poisonFailed, observed{uuid: msg.UUID, attempt: attempt, err: err})
}

func pfNewForwarder(t *testing.T, cfg middleware.PoisonForwarderConfig) *middleware.PoisonForwarder {
	t.Helper()
	if cfg.Now == nil {
		cfg.Now = func() time.Time { return pfFixedNow }
	}
	f, err := middleware.NewPoisonForwarder(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func pfFailWith(err error) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("produced", nil)}, err
	}
}

func pfNewMsg() *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(`{"id":42}`))
}

type pfResult struct {
	out []*message.Message
	err error
}

// pfRunInRouter delivers msg on topic "orders" to a real message.Router handler
// named "orders-handler", wrapped in mw. It returns what mw(h) returned. The
// outermost layer acks, so the message is handled exactly once.
func pfRunInRouter(t *testing.T, msg *message.Message, mw message.HandlerMiddleware, h message.HandlerFunc) pfResult {
	t.Helper()
	in := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = in.Close() })
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	results := make(chan pfResult, 1)
	r.AddConsumerHandler("orders-handler", "orders", in, func(m *message.Message) error {
		out, err := mw(h)(m)
		results <- pfResult{out, err}
		return nil
	})
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		_ = r.Close()
		if err := pfRecv(t, runErr, 5*time.Second); err != nil {
			t.Errorf("router Run: %v", err)
		}
	})
	pfRecv(t, r.Running(), 5*time.Second)
	if err := in.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	return pfRecv(t, results, 5*time.Second)
}

func TestForwarderPoisonsPermanentInRouter(t *testing.T) {
	poisonPS := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer poisonPS.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	poisoned, err := poisonPS.Subscribe(ctx, "poison")
	if err != nil {
		t.Fatal(err)
	}
	obs := &pfRecObserver{}
	f := pfNewForwarder(t, middleware.PoisonForwarderConfig{Publisher: poisonPS, Observer: obs})

	msg := pfNewMsg()
	msg.Metadata.Set("user-key", "user-value")
	msg.Metadata.Set(middleware.AttemptKey, "2")
	earlier := "2025-01-01T00:00:00Z"
	msg.Metadata.Set(middleware.FirstFailureKey, earlier)
	msg.Metadata.Set(middleware.XDeathKey, `[]`)
	msg.Metadata.Set(retrymeta.DeliveryExchangeKey, "orders-ex")
	msg.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true") // a copy of this queue's chain, as the Marshaler tells

	res := pfRunInRouter(t, msg, f.Middleware, pfFailWith(middleware.Permanent(errors.New("order 42 refused"))))
	if res.err != nil || res.out != nil {
		t.Fatalf("a poisoned message must be acked with no output: %v, %v", res.out, res.err)
	}
	p := pfRecv(t, poisoned, 5*time.Second)
	p.Ack()
	if p.UUID != msg.UUID || string(p.Payload) != `{"id":42}` {
		t.Errorf("poison copy UUID/payload %s %q", p.UUID, p.Payload)
	}
	ts := pfFixedNow.Format(time.RFC3339Nano)
	want := map[string]string{
		"user-key":                       "user-value",
		retrymeta.PoisonReasonKey:        "order 42 refused",
		retrymeta.PoisonTopicKey:         "orders",
		retrymeta.PoisonHandlerKey:       "orders-handler",
		retrymeta.PoisonSubscriberKey:    "gochannel.GoChannel",
		middleware.PoisonAttemptsKey:     "2",
		middleware.PoisonedAtKey:         ts,
		middleware.ErrorClassKey:         middleware.ClassPermanent,
		middleware.FirstFailureKey:       earlier,
		middleware.LastFailureKey:        ts,
		middleware.LastErrorKey:          "order 42 refused",
		middleware.OriginalQueueKey:      "orders",
		middleware.OriginalExchangeKey:   "orders-ex",
		middleware.OriginalRoutingKeyKey: "",
	}
	for k, v := range want {
		if got, ok := p.Metadata[k]; !ok || got != v {
			t.Errorf("poison metadata %s = %q (present %v), want %q", k, got, ok, v)
		}
	}
	for _, k := range []string{middleware.XDeathKey, retrymeta.DeliveryExchangeKey} {
		if _, ok := p.Metadata[k]; ok {
			t.Errorf("poison copy carries delivery-only key %s", k)
		}
	}
	// One attempt count (issue #20 item 8): PoisonAttemptsKey, not also the
	// delivery's own attempt numbers.
	for _, k := range []string{middleware.AttemptKey, retrymeta.ProvenAttemptKey} {
		if v, ok := p.Metadata[k]; ok {
			t.Errorf("poison copy carries %s=%q beside %s", k, v, middleware.PoisonAttemptsKey)
		}
	}
	// The key names are Watermill's own.
	for k, v := range map[string]string{retrymeta.PoisonReasonKey: "reason_poisoned", retrymeta.PoisonTopicKey: "topic_poisoned", retrymeta.PoisonHandlerKey: "handler_poisoned", retrymeta.PoisonSubscriberKey: "subscriber_poisoned", middleware.PoisonAttemptsKey: "rabbitretry-attempts"} {
		if k != v {
			t.Errorf("key %q, want %q", k, v)
		}
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.poisoned) != 1 || obs.poisoned[0] != (observed{uuid: msg.UUID, attempt: 2, class: middleware.ClassPermanent}) || len(obs.poisonFailed) != 0 {
		t.Errorf("observer: poisoned %+v failed %+v", obs.poisoned, obs.poisonFailed)
	}
	select {
	case extra := <-poisoned:
		t.Fatalf("a second poison message %s", extra.UUID)
	default:
	}
}

func TestForwarderWithCounterInRouter(t *testing.T) {
	pub := &pfRecordingPublisher{}
	f := pfNewForwarder(t, middleware.PoisonForwarderConfig{Publisher: pub})
	// The sources amqpretry.New gives the chain (the counter's default is
	// the attempt header only).
	counter, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: amqpwire.Sources(nil, false)})
	if err != nil {
		t.Fatal(err)
	}
	msg := pfNewMsg()
	msg.Metadata.Set(middleware.AttemptKey, "1")
	msg.Metadata.Set(middleware.XDeathKey, wire.EncodeXDeath([]amqpwire.DeathRecord{{Queue: "orders", Reason: "rejected", Count: 3}}))
	// This queue's own evidence: a copy of its chain (gochannel: the origin
	// queue is this one), back through a retry route.
	msg.Metadata.Set(middleware.OriginalQueueKey, "orders")
	msg.Metadata.Set(retrymeta.DeliveryRetryRouteKey, "true")
	mw := func(h message.HandlerFunc) message.HandlerFunc { return counter.Middleware(f.Middleware(h)) }
	res := pfRunInRouter(t, msg, mw, pfFailWith(&chainerr.ExhaustedError{Err: errors.New("down"), Attempts: 4}))
	if res.err != nil {
		t.Fatal(res.err)
	}
	topics, msgs := pub.published()
	if len(msgs) != 1 || topics[0] != "poison" {
		t.Fatalf("published %d to %v", len(msgs), topics)
	}
	md := msgs[0].Metadata
	if md.Get(middleware.PoisonAttemptsKey) != "4" || md.Get(middleware.ErrorClassKey) != middleware.ClassExhausted || md.Get(retrymeta.PoisonReasonKey) != "gave up after 4 attempts: down" {
		t.Fatalf("metadata %v", md)
	}
}

func TestForwarderClasses(t *testing.T) {
	var typeErr error
	{
		var v struct{ N int }
		typeErr = json.Unmarshal([]byte(`{"N":"x"}`), &v)
	}
	custom := &middleware.ClassifiedError{Err: errors.New("nope"), Classification: middleware.Classification{Action: middleware.ActionPoison, Class: "custom"}}
	tests := []struct {
		name  string
		err   error
		class string
	}{
		{"permanent", middleware.Permanent(errors.New("x")), middleware.ClassPermanent},
		{"malformed json", fmt.Errorf("decode: %w", typeErr), middleware.ClassMalformed},
		{"exhausted", &chainerr.ExhaustedError{Err: errors.New("x"), Attempts: 5}, middleware.ClassExhausted},
		{"exhausted wins over inner class", &chainerr.ExhaustedError{Err: &middleware.ClassifiedError{Err: errors.New("x"), Classification: middleware.Classification{Class: "transient"}}, Attempts: 5}, middleware.ClassExhausted},
		{"classified", custom, "custom"},
		{"classified by the Classifier", nil, "custom-rule"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pub := &pfRecordingPublisher{}
			obs := &pfRecObserver{}
			f := pfNewForwarder(t, middleware.PoisonForwarderConfig{Publisher: pub, Observer: obs})
			h := pfFailWith(tc.err)
			if tc.err == nil {
				c, err := middleware.NewClassifier(middleware.ClassifierConfig{Default: middleware.ActionPoison, DefaultClass: "custom-rule"})
				if err != nil {
					t.Fatal(err)
				}
				h = c.Middleware(pfFailWith(errors.New("anything")))
			}
			msg := pfNewMsg()
			msg.SetContext(middleware.ContextWithAttempt(context.Background(), 5))
			out, err := f.Middleware(h)(msg)
			if err != nil || out != nil {
				t.Fatalf("got %v, %v", out, err)
			}
			_, msgs := pub.published()
			if len(msgs) != 1 {
				t.Fatalf("published %d", len(msgs))
			}
			if got := msgs[0].Metadata.Get(middleware.ErrorClassKey); got != tc.class {
				t.Errorf("class %q, want %q", got, tc.class)
			}
			if got := msgs[0].Metadata.Get(middleware.PoisonAttemptsKey); got != "5" {
				t.Errorf("attempts %q", got)
			}
			// Outside a router the context names are empty, but present.
			for _, k := range []string{retrymeta.PoisonTopicKey, retrymeta.PoisonHandlerKey, retrymeta.PoisonSubscriberKey} {
				if v, ok := msgs[0].Metadata[k]; !ok || v != "" {
					t.Errorf("%s = %q present %v", k, v, ok)
				}
			}
			if _, ok := msgs[0].Metadata[middleware.OriginalQueueKey]; ok {
				t.Error("no queue name known, yet OriginalQueueKey set")
			}
			obs.mu.Lock()
			defer obs.mu.Unlock()
			if len(obs.poisoned) != 1 || obs.poisoned[0].class != tc.class || obs.poisoned[0].attempt != 5 {
				t.Errorf("observer %+v", obs.poisoned)
			}
		})
	}
}

func TestForwarderPassesNonPoisonErrors(t *testing.T) {
	pub := &pfRecordingPublisher{}
	f := pfNewForwarder(t, middleware.PoisonForwarderConfig{Publisher: pub})
	tests := []error{
		errors.New("transient"),
		context.Canceled,
		middleware.RetryAfter(errors.New("429"), time.Second),
		&middleware.ClassifiedError{Err: middleware.Permanent(errors.New("x")), Classification: middleware.Classification{Action: middleware.ActionRetry, Class: "transient"}},
		// A failed retry schedule is never poisoned, whatever it wraps.
		&chainerr.ScheduleError{Err: errors.New("no confirm"), HandlerErr: middleware.Permanent(errors.New("x")), Attempt: 5},
		&chainerr.ScheduleError{Err: &chainerr.ExhaustedError{Err: errors.New("x"), Attempts: 9}, HandlerErr: errors.New("x"), Attempt: 9},
		fmt.Errorf("wrapped: %w", &chainerr.ScheduleError{Err: middleware.Permanent(errors.New("x")), Attempt: 1}),
	}
	for _, herr := range tests {
		out, err := f.Middleware(pfFailWith(herr))(pfNewMsg())
		if err != herr {
			t.Errorf("%v: returned %v, want the error unchanged", herr, err)
		}
		if len(out) != 1 {
			t.Errorf("%v: produced messages changed: %v", herr, out)
		}
	}
	if _, msgs := pub.published(); len(msgs) != 0 {
		t.Fatalf("published %d poison messages for non-poison errors", len(msgs))
	}
	for i, herr := range tests {
		if middleware.DefaultShouldPoison(herr) {
			t.Errorf("DefaultShouldPoison(tests[%d]) = true", i)
		}
	}
	produced := []*message.Message{pfNewMsg()}
	out, err := f.Middleware(func(*message.Message) ([]*message.Message, error) { return produced, nil })(pfNewMsg())
	if err != nil || len(out) != 1 || out[0] != produced[0] {
		t.Fatalf("success: %v %v", out, err)
	}
}

func TestForwarderPublishFailureNacks(t *testing.T) {
	pubErr := errors.New("poison exchange unreachable")
	pub := &pfRecordingPublisher{err: pubErr}
	obs := &pfRecObserver{}
	logger := &pfSyncLogger{}
	f := pfNewForwarder(t, middleware.PoisonForwarderConfig{Publisher: pub, Observer: obs, Logger: logger})
	handlerErr := middleware.Permanent(errors.New("refused"))
	msg := pfNewMsg()
	msg.SetContext(middleware.ContextWithAttempt(context.Background(), 3))
	out, err := f.Middleware(pfFailWith(handlerErr))(msg)
	if err == nil {
		t.Fatal("a failed poison publish must return an error (nack), not nil (ack)")
	}
	if out != nil {
		t.Errorf("output %v", out)
	}
	var pe *chainerr.PoisonError
	if !errors.As(err, &pe) || !errors.Is(err, pubErr) || pe.HandlerErr != handlerErr {
		t.Fatalf("got %T %v, want *PoisonError", err, err)
	}
	if !strings.Contains(err.Error(), "unreachable") || !strings.Contains(err.Error(), "refused") {
		t.Errorf("text %q", err.Error())
	}
	// The PoisonError is not itself poisoned by an outer forwarder.
	if middleware.DefaultShouldPoison(err) {
		t.Error("DefaultShouldPoison(*PoisonError) = true")
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.poisoned) != 0 || len(obs.poisonFailed) != 1 || obs.poisonFailed[0].attempt != 3 || !errors.Is(obs.poisonFailed[0].err, pubErr) {
		t.Errorf("observer poisoned %+v failed %+v", obs.poisoned, obs.poisonFailed)
	}
	if errs := logger.level("error"); len(errs) != 1 || !errors.Is(errs[0].err, pubErr) {
		t.Errorf("error logs %+v", errs)
	}
}

func TestForwarderErrorTextTruncated(t *testing.T) {
	pub := &pfRecordingPublisher{}
	f := pfNewForwarder(t, middleware.PoisonForwarderConfig{Publisher: pub})
	long := strings.Repeat("é", 3000) // 6000 bytes, 2-byte runes
	if _, err := f.Middleware(pfFailWith(middleware.Permanent(errors.New(long))))(pfNewMsg()); err != nil {
		t.Fatal(err)
	}
	_, msgs := pub.published()
	for _, k := range []string{retrymeta.PoisonReasonKey, middleware.LastErrorKey} {
		v := msgs[0].Metadata.Get(k)
		if len(v) > retrymeta.DefaultMaxErrorBytes || len(v) < retrymeta.DefaultMaxErrorBytes-4 {
			t.Errorf("%s is %d bytes, want at most (and close to) %d", k, len(v), retrymeta.DefaultMaxErrorBytes)
		}
		if !strings.HasSuffix(v, "…") || !strings.HasPrefix(v, "éé") || !strings.HasPrefix(long, strings.TrimSuffix(v, "…")) {
			t.Errorf("%s not cut on a rune boundary with a mark", k)
		}
	}
}

func TestForwarderCustomConfig(t *testing.T) {
	pub := &pfRecordingPublisher{}
	f := pfNewForwarder(t, middleware.PoisonForwarderConfig{
		Publisher: pub,
		Topic:     func(ctx context.Context) string { return "dead-letters" },
		QueueName: func(ctx context.Context) string { return "q-orders" },
		ErrorText: func(err error) string {
			return strings.ReplaceAll(err.Error(), "hunter2", "[redacted]")
		},
		ShouldPoison: func(err error) bool { return strings.Contains(err.Error(), "poison me") },
	})
	if _, err := f.Middleware(pfFailWith(errors.New("poison me: password=hunter2")))(pfNewMsg()); err != nil {
		t.Fatal(err)
	}
	herr := middleware.Permanent(errors.New("not matched"))
	if _, err := f.Middleware(pfFailWith(herr))(pfNewMsg()); err != herr {
		t.Fatalf("custom ShouldPoison rejected the error, want it returned unchanged: %v", err)
	}
	topics, msgs := pub.published()
	if len(msgs) != 1 || topics[0] != "dead-letters" {
		t.Fatalf("published %d to %v", len(msgs), topics)
	}
	md := msgs[0].Metadata
	if md.Get(retrymeta.PoisonReasonKey) != "poison me: password=[redacted]" || md.Get(middleware.LastErrorKey) != "poison me: password=[redacted]" {
		t.Errorf("error text not redacted: %q / %q", md.Get(retrymeta.PoisonReasonKey), md.Get(middleware.LastErrorKey))
	}
	for k, v := range md {
		if strings.Contains(v, "hunter2") {
			t.Errorf("%s leaks the secret: %q", k, v)
		}
	}
	if md.Get(middleware.OriginalQueueKey) != "q-orders" {
		t.Errorf("original queue %q", md.Get(middleware.OriginalQueueKey))
	}
	// Unclassified transient error: class is the default classifier's.
	if md.Get(middleware.ErrorClassKey) != middleware.ClassTransient {
		t.Errorf("class %q", md.Get(middleware.ErrorClassKey))
	}
}

func TestForwarderValidate(t *testing.T) {
	f, err := middleware.NewPoisonForwarder(middleware.PoisonForwarderConfig{})
	if err == nil || f != nil || !strings.Contains(err.Error(), "Publisher") {
		t.Fatalf("got %v, %v", f, err)
	}
}

// pfSyncLogger is a goroutine-safe recording logger.
type pfSyncLogger struct {
	mu      sync.Mutex
	entries []pfLogEntry
}

type pfLogEntry struct {
	level  string
	msg    string
	err    error
	fields watermill.LogFields
}

func (l *pfSyncLogger) add(level, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, pfLogEntry{level: level, msg: msg, err: err, fields: fields})
}
func (l *pfSyncLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.add("error", msg, err, fields)
}
func (l *pfSyncLogger) Info(msg string, fields watermill.LogFields)      { l.add("info", msg, nil, fields) }
func (l *pfSyncLogger) Debug(string, watermill.LogFields)                {}
func (l *pfSyncLogger) Trace(string, watermill.LogFields)                {}
func (l *pfSyncLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }
func (l *pfSyncLogger) level(level string) []pfLogEntry {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []pfLogEntry
	for _, e := range l.entries {
		if e.level == level {
			out = append(out, e)
		}
	}
	return out
}

func pfRecv[T any](t testing.TB, ch <-chan T, timeout time.Duration) T {
	t.Helper()
	return testkit.Recv(t, ch, timeout)
}
