package poison_test

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
	"github.com/rabbitretry/rabbitretry/internal/testkit"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/poison"
)

var fixedNow = time.Date(2025, 6, 7, 8, 9, 10, 123456789, time.UTC)

// recordingPublisher records published messages, or fails with err.
type recordingPublisher struct {
	mu     sync.Mutex
	topics []string
	msgs   []*message.Message
	err    error
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
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

func (p *recordingPublisher) Close() error { return nil }

func (p *recordingPublisher) published() ([]string, []*message.Message) {
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

type recObserver struct {
	middleware.NopObserver
	mu           sync.Mutex
	poisoned     []observed
	poisonFailed []observed
}

func (o *recObserver) Poisoned(msg *message.Message, attempt int, class string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.poisoned = append(o.poisoned, observed{uuid: msg.UUID, attempt: attempt, class: class})
}

func (o *recObserver) PoisonFailed(msg *message.Message, attempt int, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.poisonFailed = append(o.poisonFailed, observed{uuid: msg.UUID, attempt: attempt, err: err})
}

func newForwarder(t *testing.T, cfg poison.ForwarderConfig) *poison.Forwarder {
	t.Helper()
	if cfg.Now == nil {
		cfg.Now = func() time.Time { return fixedNow }
	}
	f, err := poison.NewForwarder(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func failWith(err error) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("produced", nil)}, err
	}
}

func newMsg() *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(`{"id":42}`))
}

type result struct {
	out []*message.Message
	err error
}

// runInRouter delivers msg on topic "orders" to a real message.Router handler
// named "orders-handler", wrapped in mw. It returns what mw(h) returned. The
// outermost layer acks, so the message is handled exactly once.
func runInRouter(t *testing.T, msg *message.Message, mw message.HandlerMiddleware, h message.HandlerFunc) result {
	t.Helper()
	in := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = in.Close() })
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	results := make(chan result, 1)
	r.AddConsumerHandler("orders-handler", "orders", in, func(m *message.Message) error {
		out, err := mw(h)(m)
		results <- result{out, err}
		return nil
	})
	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		_ = r.Close()
		if err := recv(t, runErr, 5*time.Second); err != nil {
			t.Errorf("router Run: %v", err)
		}
	})
	recv(t, r.Running(), 5*time.Second)
	if err := in.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	return recv(t, results, 5*time.Second)
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
	obs := &recObserver{}
	f := newForwarder(t, poison.ForwarderConfig{Publisher: poisonPS, Observer: obs})

	msg := newMsg()
	msg.Metadata.Set("user-key", "user-value")
	msg.Metadata.Set(middleware.AttemptKey, "2")
	earlier := "2025-01-01T00:00:00Z"
	msg.Metadata.Set(middleware.FirstFailureKey, earlier)
	msg.Metadata.Set(middleware.XDeathKey, `[]`)
	msg.Metadata.Set(middleware.DeliveryExchangeKey, "orders-ex")
	msg.Metadata.Set(middleware.DeliveryRetryPathKey, "true") // a copy of this queue's chain, as the Marshaler tells

	res := runInRouter(t, msg, f.Middleware, failWith(middleware.Permanent(errors.New("order 42 refused"))))
	if res.err != nil || res.out != nil {
		t.Fatalf("a poisoned message must be acked with no output: %v, %v", res.out, res.err)
	}
	p := recv(t, poisoned, 5*time.Second)
	p.Ack()
	if p.UUID != msg.UUID || string(p.Payload) != `{"id":42}` {
		t.Errorf("poison copy UUID/payload %s %q", p.UUID, p.Payload)
	}
	ts := fixedNow.Format(time.RFC3339Nano)
	want := map[string]string{
		"user-key":                       "user-value",
		poison.ReasonKey:                 "order 42 refused",
		poison.TopicKey:                  "orders",
		poison.HandlerKey:                "orders-handler",
		poison.SubscriberKey:             "gochannel.GoChannel",
		middleware.PoisonAttemptsKey:     "2",
		middleware.PoisonedAtKey:         ts,
		middleware.AttemptKey:            "2",
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
	for _, k := range []string{middleware.XDeathKey, middleware.DeliveryExchangeKey} {
		if _, ok := p.Metadata[k]; ok {
			t.Errorf("poison copy carries delivery-only key %s", k)
		}
	}
	// The key names are Watermill's own.
	for k, v := range map[string]string{poison.ReasonKey: "reason_poisoned", poison.TopicKey: "topic_poisoned", poison.HandlerKey: "handler_poisoned", poison.SubscriberKey: "subscriber_poisoned", middleware.PoisonAttemptsKey: "rabbitretry-attempts"} {
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
	pub := &recordingPublisher{}
	f := newForwarder(t, poison.ForwarderConfig{Publisher: pub})
	// The sources amqpretry.New gives the chain (x-death counts; the
	// counter's default is the attempt header only).
	counter, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: amqpwire.Sources(nil, false)})
	if err != nil {
		t.Fatal(err)
	}
	msg := newMsg()
	msg.Metadata.Set(middleware.AttemptKey, "1")
	msg.Metadata.Set(middleware.XDeathKey, amqpwire.EncodeXDeath([]amqpwire.DeathRecord{{Queue: "orders", Reason: "rejected", Count: 3}}))
	// This queue's own evidence: a copy of its chain (gochannel: the origin
	// queue is this one), back through a retry route.
	msg.Metadata.Set(middleware.OriginalQueueKey, "orders")
	msg.Metadata.Set(middleware.DeliveryRetryRouteKey, "true")
	mw := func(h message.HandlerFunc) message.HandlerFunc { return counter.Middleware(f.Middleware(h)) }
	res := runInRouter(t, msg, mw, failWith(&middleware.ExhaustedError{Err: errors.New("down"), Attempts: 4}))
	if res.err != nil {
		t.Fatal(res.err)
	}
	topics, msgs := pub.published()
	if len(msgs) != 1 || topics[0] != "poison" {
		t.Fatalf("published %d to %v", len(msgs), topics)
	}
	md := msgs[0].Metadata
	if md.Get(middleware.PoisonAttemptsKey) != "4" || md.Get(middleware.ErrorClassKey) != middleware.ClassExhausted || md.Get(poison.ReasonKey) != "gave up after 4 attempts: down" {
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
		{"exhausted", &middleware.ExhaustedError{Err: errors.New("x"), Attempts: 5}, middleware.ClassExhausted},
		{"exhausted wins over inner class", &middleware.ExhaustedError{Err: &middleware.ClassifiedError{Err: errors.New("x"), Classification: middleware.Classification{Class: "transient"}}, Attempts: 5}, middleware.ClassExhausted},
		{"classified", custom, "custom"},
		{"classified by the Classifier", nil, "custom-rule"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pub := &recordingPublisher{}
			obs := &recObserver{}
			f := newForwarder(t, poison.ForwarderConfig{Publisher: pub, Observer: obs})
			h := failWith(tc.err)
			if tc.err == nil {
				c, err := middleware.NewClassifier(middleware.ClassifierConfig{Default: middleware.ActionPoison, DefaultClass: "custom-rule"})
				if err != nil {
					t.Fatal(err)
				}
				h = c.Middleware(failWith(errors.New("anything")))
			}
			msg := newMsg()
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
			for _, k := range []string{poison.TopicKey, poison.HandlerKey, poison.SubscriberKey} {
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
	pub := &recordingPublisher{}
	f := newForwarder(t, poison.ForwarderConfig{Publisher: pub})
	tests := []error{
		errors.New("transient"),
		context.Canceled,
		middleware.RetryAfter(errors.New("429"), time.Second),
		&middleware.ClassifiedError{Err: middleware.Permanent(errors.New("x")), Classification: middleware.Classification{Action: middleware.ActionRetry, Class: "transient"}},
		// A failed retry schedule is never poisoned, whatever it wraps.
		&middleware.ScheduleError{Err: errors.New("no confirm"), HandlerErr: middleware.Permanent(errors.New("x")), Attempt: 5},
		&middleware.ScheduleError{Err: &middleware.ExhaustedError{Err: errors.New("x"), Attempts: 9}, HandlerErr: errors.New("x"), Attempt: 9},
		fmt.Errorf("wrapped: %w", &middleware.ScheduleError{Err: middleware.Permanent(errors.New("x")), Attempt: 1}),
	}
	for _, herr := range tests {
		out, err := f.Middleware(failWith(herr))(newMsg())
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
		if poison.DefaultShouldPoison(herr) {
			t.Errorf("DefaultShouldPoison(tests[%d]) = true", i)
		}
	}
	produced := []*message.Message{newMsg()}
	out, err := f.Middleware(func(*message.Message) ([]*message.Message, error) { return produced, nil })(newMsg())
	if err != nil || len(out) != 1 || out[0] != produced[0] {
		t.Fatalf("success: %v %v", out, err)
	}
}

func TestForwarderPublishFailureNacks(t *testing.T) {
	pubErr := errors.New("poison exchange unreachable")
	pub := &recordingPublisher{err: pubErr}
	obs := &recObserver{}
	logger := &syncLogger{}
	f := newForwarder(t, poison.ForwarderConfig{Publisher: pub, Observer: obs, Logger: logger})
	handlerErr := middleware.Permanent(errors.New("refused"))
	msg := newMsg()
	msg.SetContext(middleware.ContextWithAttempt(context.Background(), 3))
	out, err := f.Middleware(failWith(handlerErr))(msg)
	if err == nil {
		t.Fatal("a failed poison publish must return an error (nack), not nil (ack)")
	}
	if out != nil {
		t.Errorf("output %v", out)
	}
	var pe *poison.PoisonError
	if !errors.As(err, &pe) || !errors.Is(err, pubErr) || pe.HandlerErr != handlerErr {
		t.Fatalf("got %T %v, want *PoisonError", err, err)
	}
	if !strings.Contains(err.Error(), "unreachable") || !strings.Contains(err.Error(), "refused") {
		t.Errorf("text %q", err.Error())
	}
	// The PoisonError is not itself poisoned by an outer forwarder.
	if poison.DefaultShouldPoison(err) {
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
	pub := &recordingPublisher{}
	f := newForwarder(t, poison.ForwarderConfig{Publisher: pub})
	long := strings.Repeat("é", 3000) // 6000 bytes, 2-byte runes
	if _, err := f.Middleware(failWith(middleware.Permanent(errors.New(long))))(newMsg()); err != nil {
		t.Fatal(err)
	}
	_, msgs := pub.published()
	for _, k := range []string{poison.ReasonKey, middleware.LastErrorKey} {
		v := msgs[0].Metadata.Get(k)
		if len(v) > middleware.DefaultMaxErrorBytes || len(v) < middleware.DefaultMaxErrorBytes-4 {
			t.Errorf("%s is %d bytes, want at most (and close to) %d", k, len(v), middleware.DefaultMaxErrorBytes)
		}
		if !strings.HasSuffix(v, "…") || !strings.HasPrefix(v, "éé") || !strings.HasPrefix(long, strings.TrimSuffix(v, "…")) {
			t.Errorf("%s not cut on a rune boundary with a mark", k)
		}
	}
}

func TestForwarderCustomConfig(t *testing.T) {
	pub := &recordingPublisher{}
	f := newForwarder(t, poison.ForwarderConfig{
		Publisher: pub,
		Topic:     func(ctx context.Context) string { return "dead-letters" },
		QueueName: func(ctx context.Context) string { return "q-orders" },
		ErrorText: func(err error) string {
			return strings.ReplaceAll(err.Error(), "hunter2", "[redacted]")
		},
		ShouldPoison: func(err error) bool { return strings.Contains(err.Error(), "poison me") },
	})
	if _, err := f.Middleware(failWith(errors.New("poison me: password=hunter2")))(newMsg()); err != nil {
		t.Fatal(err)
	}
	herr := middleware.Permanent(errors.New("not matched"))
	if _, err := f.Middleware(failWith(herr))(newMsg()); err != herr {
		t.Fatalf("custom ShouldPoison rejected the error, want it returned unchanged: %v", err)
	}
	topics, msgs := pub.published()
	if len(msgs) != 1 || topics[0] != "dead-letters" {
		t.Fatalf("published %d to %v", len(msgs), topics)
	}
	md := msgs[0].Metadata
	if md.Get(poison.ReasonKey) != "poison me: password=[redacted]" || md.Get(middleware.LastErrorKey) != "poison me: password=[redacted]" {
		t.Errorf("error text not redacted: %q / %q", md.Get(poison.ReasonKey), md.Get(middleware.LastErrorKey))
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
	f, err := poison.NewForwarder(poison.ForwarderConfig{})
	if err == nil || f != nil || !strings.Contains(err.Error(), "Publisher") {
		t.Fatalf("got %v, %v", f, err)
	}
}

// syncLogger is a goroutine-safe recording logger.
type syncLogger struct {
	mu      sync.Mutex
	entries []logEntry
}

type logEntry struct {
	level  string
	msg    string
	err    error
	fields watermill.LogFields
}

func (l *syncLogger) add(level, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, logEntry{level: level, msg: msg, err: err, fields: fields})
}
func (l *syncLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.add("error", msg, err, fields)
}
func (l *syncLogger) Info(msg string, fields watermill.LogFields)      { l.add("info", msg, nil, fields) }
func (l *syncLogger) Debug(string, watermill.LogFields)                {}
func (l *syncLogger) Trace(string, watermill.LogFields)                {}
func (l *syncLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }
func (l *syncLogger) level(level string) []logEntry {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []logEntry
	for _, e := range l.entries {
		if e.level == level {
			out = append(out, e)
		}
	}
	return out
}

func recv[T any](t testing.TB, ch <-chan T, timeout time.Duration) T {
	t.Helper()
	return testkit.Recv(t, ch, timeout)
}
