package middleware_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// handlerResult is what a handler chain returned for one delivery, with a
// snapshot of the message as the innermost handler saw it.
type handlerResult struct {
	out      []*message.Message
	err      error
	seenCtx  context.Context
	seenMeta message.Metadata
}

// deliverViaRouter runs msg, published to topic on a fresh gochannel, through
// a real message.Router whose handler is mw(h). It returns what mw(h) returned
// and the context and metadata h saw. The outermost layer always acks so the
// message is delivered exactly once.
func deliverViaRouter(t *testing.T, topic string, msg *message.Message, mw message.HandlerMiddleware, h message.HandlerFunc) handlerResult {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	results := make(chan handlerResult, 1)
	var seen struct {
		sync.Mutex
		ctx  context.Context
		meta message.Metadata
	}
	inner := func(m *message.Message) ([]*message.Message, error) {
		seen.Lock()
		seen.ctx = m.Context()
		seen.meta = copyMeta(m.Metadata)
		seen.Unlock()
		return h(m)
	}
	r.AddConsumerHandler("test-handler", topic, ps, func(m *message.Message) error {
		out, err := mw(inner)(m)
		seen.Lock()
		res := handlerResult{out: out, err: err, seenCtx: seen.ctx, seenMeta: seen.meta}
		seen.Unlock()
		results <- res
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
	if err := ps.Publish(topic, msg); err != nil {
		t.Fatal(err)
	}
	return recv(t, results, 5*time.Second)
}

func newMsg(payload string) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(payload))
}

func failWith(err error) message.HandlerFunc {
	return func(*message.Message) ([]*message.Message, error) { return nil, err }
}

// scheduled is one Schedule call seen by recordingDelayer.
type scheduled struct {
	ctx   context.Context
	msg   *message.Message
	delay time.Duration
}

// recordingDelayer records Schedule calls and returns err.
type recordingDelayer struct {
	mu    sync.Mutex
	calls []scheduled
	err   error
}

func (d *recordingDelayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls = append(d.calls, scheduled{ctx: ctx, msg: msg, delay: delay})
	return d.err
}

func (d *recordingDelayer) Calls() []scheduled {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]scheduled(nil), d.calls...)
}

var _ middleware.Delayer = (*recordingDelayer)(nil)

func copyMeta(md message.Metadata) message.Metadata {
	c := make(message.Metadata, len(md))
	for k, v := range md {
		c[k] = v
	}
	return c
}

// logEntry is one line logged through syncLogger.
type logEntry struct {
	level  string
	msg    string
	err    error
	fields watermill.LogFields
}

// syncLogger is a goroutine-safe recording logger (watermill's
// CaptureLoggerAdapter hands out its internal map).
type syncLogger struct {
	mu      sync.Mutex
	entries []logEntry
	fields  watermill.LogFields
}

func (l *syncLogger) add(level, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, logEntry{level: level, msg: msg, err: err, fields: l.fields.Add(fields)})
}

func (l *syncLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.add("error", msg, err, fields)
}
func (l *syncLogger) Info(msg string, fields watermill.LogFields)  { l.add("info", msg, nil, fields) }
func (l *syncLogger) Debug(msg string, fields watermill.LogFields) {}
func (l *syncLogger) Trace(msg string, fields watermill.LogFields) {}
func (l *syncLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return l // fields of With are not needed by these tests
}

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

// waitFor polls cond until it holds, failing after timeout.
func waitFor(t testing.TB, timeout time.Duration, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, timeout, "condition", cond)
}

func recv[T any](t testing.TB, ch <-chan T, timeout time.Duration) T {
	t.Helper()
	return testkit.Recv(t, ch, timeout)
}

// ownCopy marks msg the way the amqpretry Marshaler marks a copy the
// library published for its queue, back through a retry route: its attempt
// header and its queue's x-death entries count.
func ownCopy(msg *message.Message) *message.Message {
	msg.Metadata.Set(retrymeta.DeliveryExchangeKey, "")
	msg.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true")
	msg.Metadata.Set(retrymeta.DeliveryRetryRouteKey, "true")
	return msg
}
