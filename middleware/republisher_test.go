package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

var fixedNow = time.Date(2025, 3, 4, 5, 6, 7, 890, time.UTC)

type recObserver struct {
	middleware.NopObserver
	mu        sync.Mutex
	scheduled []int // attempts
	delays    []time.Duration
	failed    []error
}

func (o *recObserver) RetryScheduled(_ *message.Message, attempt int, delay, _ time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.scheduled = append(o.scheduled, attempt)
	o.delays = append(o.delays, delay)
}

func (o *recObserver) RetryFailed(_ *message.Message, _ int, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.failed = append(o.failed, err)
}

func newRepublisher(t *testing.T, cfg middleware.RepublisherConfig) *middleware.Republisher {
	t.Helper()
	if cfg.Backoff == nil {
		cfg.Backoff = exactBackoff(100 * time.Millisecond)
	}
	if cfg.Now == nil {
		cfg.Now = func() time.Time { return fixedNow }
	}
	if cfg.QueueName == nil {
		cfg.QueueName = func(context.Context) string { return "orders" }
	}
	r, err := middleware.NewRepublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// attemptMsg returns a message on attempt n, as the AttemptCounter leaves it.
func attemptMsg(n int, payload string) *message.Message {
	msg := newMsg(payload)
	msg.SetContext(middleware.ContextWithAttempt(context.Background(), n))
	return msg
}

func TestRepublisherSchedulesCopy(t *testing.T) {
	d := &recordingDelayer{}
	obs := &recObserver{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, MaxAttempts: 5, Observer: obs})

	msg := attemptMsg(2, `{"order":1}`)
	msg.Metadata.Set("user-key", "user-value")
	msg.Metadata.Set(middleware.AttemptKey, "2")
	earlier := "2024-01-01T00:00:00Z"
	msg.Metadata.Set(middleware.FirstFailureKey, earlier)
	msg.Metadata.Set(middleware.XDeathKey, `[{"queue":"orders","reason":"rejected","count":1}]`)
	msg.Metadata.Set(retrymeta.XDeliveryCountKey, "1")
	msg.Metadata.Set(retrymeta.DeliveryExchangeKey, "orders-ex")
	msg.Metadata.Set(retrymeta.DeliveryRoutingKeyKey, "orders.created")
	msg.Metadata.Set(retrymeta.HeaderErrorKey, "something ignored")

	handlerErr := errors.New("db unavailable")
	out, err := r.Middleware(func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{newMsg("produced on a failed attempt")}, handlerErr
	})(msg)
	if err != nil || out != nil {
		t.Fatalf("scheduled retry must ack with no output: got %v, %v", out, err)
	}

	calls := d.Calls()
	if len(calls) != 1 {
		t.Fatalf("Schedule called %d times, want 1", len(calls))
	}
	c := calls[0]
	if c.delay != 200*time.Millisecond {
		t.Errorf("delay %v, want backoff after attempt 2 = 200ms", c.delay)
	}
	if c.ctx != msg.Context() {
		t.Error("Schedule must get the original message's context")
	}
	cp := c.msg
	if cp == msg {
		t.Fatal("Schedule got the original message, not a copy")
	}
	if cp.UUID != msg.UUID || string(cp.Payload) != `{"order":1}` {
		t.Errorf("copy UUID/payload %q %q", cp.UUID, cp.Payload)
	}
	want := map[string]string{
		"user-key":                       "user-value",
		middleware.AttemptKey:            "3",
		retrymeta.ProvenAttemptKey:       "3",
		middleware.FirstFailureKey:       earlier,
		middleware.LastFailureKey:        fixedNow.Format(time.RFC3339Nano),
		middleware.ErrorClassKey:         middleware.ClassTransient,
		middleware.LastErrorKey:          "db unavailable",
		middleware.DelayKey:              "200",
		middleware.OriginalExchangeKey:   "orders-ex",
		middleware.OriginalRoutingKeyKey: "orders.created",
		middleware.OriginalQueueKey:      "orders",
	}
	for k, v := range want {
		if got, ok := cp.Metadata[k]; !ok || got != v {
			t.Errorf("copy metadata %s = %q (present %v), want %q", k, got, ok, v)
		}
	}
	for _, k := range []string{middleware.XDeathKey, retrymeta.XDeliveryCountKey, retrymeta.DeliveryExchangeKey, retrymeta.DeliveryRoutingKeyKey, retrymeta.HeaderErrorKey} {
		if _, ok := cp.Metadata[k]; ok {
			t.Errorf("copy still carries delivery-only key %s", k)
		}
	}
	if len(cp.Metadata) != len(want) {
		t.Errorf("copy has %d metadata keys, want %d: %v", len(cp.Metadata), len(want), cp.Metadata)
	}
	// The original is untouched.
	if msg.Metadata.Get(middleware.AttemptKey) != "2" || msg.Metadata.Get(middleware.XDeathKey) == "" || msg.Metadata.Get(middleware.LastErrorKey) != "" {
		t.Errorf("original metadata modified: %v", msg.Metadata)
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.scheduled) != 1 || obs.scheduled[0] != 2 || obs.delays[0] != 200*time.Millisecond || len(obs.failed) != 0 {
		t.Errorf("observer: scheduled %v delays %v failed %v", obs.scheduled, obs.delays, obs.failed)
	}
}

func TestRepublisherFirstFailureSetOnce(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d})
	msg := attemptMsg(1, "p")
	if _, err := r.Middleware(failWith(errors.New("x")))(msg); err != nil {
		t.Fatal(err)
	}
	cp := d.Calls()[0].msg
	ts := fixedNow.Format(time.RFC3339Nano)
	if cp.Metadata.Get(middleware.FirstFailureKey) != ts || cp.Metadata.Get(middleware.LastFailureKey) != ts {
		t.Errorf("first/last failure %q %q, want %q", cp.Metadata.Get(middleware.FirstFailureKey), cp.Metadata.Get(middleware.LastFailureKey), ts)
	}
	if cp.Metadata.Get(middleware.AttemptKey) != "2" || cp.Metadata.Get(middleware.DelayKey) != "100" {
		t.Errorf("attempt %q delay %q", cp.Metadata.Get(middleware.AttemptKey), cp.Metadata.Get(middleware.DelayKey))
	}
	// No delivery exchange: the original exchange is recorded empty, but present.
	if v, ok := cp.Metadata[middleware.OriginalExchangeKey]; !ok || v != "" {
		t.Errorf("original exchange %q present %v", v, ok)
	}
	// On a delivery that came back through the retry path, the original
	// exchange already recorded is kept; the original queue is always the
	// consuming queue (see TestRecordFailureOrigin).
	msg2 := attemptMsg(2, "p")
	msg2.Metadata.Set(middleware.OriginalQueueKey, "first-queue")
	msg2.Metadata.Set(middleware.OriginalExchangeKey, "first-ex")
	msg2.Metadata.Set(retrymeta.DeliveryExchangeKey, "now-ex")
	msg2.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true")
	if _, err := r.Middleware(failWith(errors.New("x")))(msg2); err != nil {
		t.Fatal(err)
	}
	cp2 := d.Calls()[1].msg
	if cp2.Metadata.Get(middleware.OriginalQueueKey) != "orders" || cp2.Metadata.Get(middleware.OriginalExchangeKey) != "first-ex" {
		t.Errorf("original queue/exchange: %v", cp2.Metadata)
	}
	if _, ok := cp2.Metadata[retrymeta.DeliveryRetryPathKey]; ok {
		t.Error("the copy carries the delivery-only retry-path mark")
	}
}

func TestRepublisherDelayerErrorNacks(t *testing.T) {
	schedErr := errors.New("broker did not confirm")
	d := &recordingDelayer{err: schedErr}
	obs := &recObserver{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, Observer: obs})
	handlerErr := errors.New("transient")
	out, err := r.Middleware(func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{newMsg("x")}, handlerErr
	})(attemptMsg(2, "p"))
	if err == nil {
		t.Fatal("a failed Schedule must return an error (nack), not nil (ack)")
	}
	if out != nil {
		t.Errorf("produced messages must be discarded, got %d", len(out))
	}
	var se *chainerr.ScheduleError
	if !errors.As(err, &se) {
		t.Fatalf("got %T %v, want *ScheduleError", err, err)
	}
	if se.Attempt != 2 || !errors.Is(err, schedErr) || se.HandlerErr != handlerErr {
		t.Errorf("ScheduleError %+v", se)
	}
	if !strings.Contains(err.Error(), "broker did not confirm") || !strings.Contains(err.Error(), "transient") {
		t.Errorf("error text %q", err.Error())
	}
	if len(d.Calls()) != 1 {
		t.Errorf("Schedule called %d times", len(d.Calls()))
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.failed) != 1 || !errors.Is(obs.failed[0], schedErr) || len(obs.scheduled) != 0 {
		t.Errorf("observer failed %v scheduled %v", obs.failed, obs.scheduled)
	}
}

func TestRepublisherExhausted(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, MaxAttempts: 3})
	if r.MaxAttempts() != 3 {
		t.Fatalf("MaxAttempts() = %d", r.MaxAttempts())
	}
	handlerErr := errors.New("still down")
	for _, attempt := range []int{3, 4, middleware.MaxAttemptsCap} {
		ran := false
		out, err := r.Middleware(func(*message.Message) ([]*message.Message, error) {
			ran = true
			return []*message.Message{newMsg("x")}, handlerErr
		})(attemptMsg(attempt, "p"))
		var ex *chainerr.ExhaustedError
		if !errors.As(err, &ex) || ex.Attempts != attempt {
			t.Fatalf("attempt %d: got %T %v, want *ExhaustedError", attempt, err, err)
		}
		// The last attempt runs the handler; an attempt already past
		// MaxAttempts goes to the poison queue without running it.
		if wantRun := attempt <= 3; ran != wantRun || (wantRun && !errors.Is(err, handlerErr)) {
			t.Fatalf("attempt %d: handler ran %v (want %v), err %v", attempt, ran, wantRun, err)
		}
		if out != nil {
			t.Errorf("attempt %d: produced messages not discarded", attempt)
		}
	}
	if n := len(d.Calls()); n != 0 {
		t.Fatalf("Delayer called %d times on exhausted messages", n)
	}
	// attempt 2 of 3 is still retried.
	if _, err := r.Middleware(failWith(handlerErr))(attemptMsg(2, "p")); err != nil || len(d.Calls()) != 1 {
		t.Fatalf("attempt 2: %v, %d calls", err, len(d.Calls()))
	}
}

func TestRepublisherMaxAttemptsOneNeverRetries(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, MaxAttempts: 1})
	_, err := r.Middleware(failWith(errors.New("x")))(attemptMsg(1, "p"))
	var ex *chainerr.ExhaustedError
	if !errors.As(err, &ex) || ex.Attempts != 1 || len(d.Calls()) != 0 {
		t.Fatalf("got %v, %d calls", err, len(d.Calls()))
	}
}

func TestRepublisherBackoffStopExhausts(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, MaxAttempts: 10, Backoff: func() backoff.BackOff {
		return backoff.WithMaxRetries(backoff.NewConstantBackOff(20*time.Millisecond), 1)
	}})
	if _, err := r.Middleware(failWith(errors.New("x")))(attemptMsg(1, "p")); err != nil {
		t.Fatalf("attempt 1: %v", err)
	}
	_, err := r.Middleware(failWith(errors.New("x")))(attemptMsg(2, "p"))
	var ex *chainerr.ExhaustedError
	if !errors.As(err, &ex) || ex.Attempts != 2 {
		t.Fatalf("attempt 2 with a stopped policy: %v", err)
	}
	if len(d.Calls()) != 1 || d.Calls()[0].delay != 20*time.Millisecond {
		t.Fatalf("calls %v", d.Calls())
	}
}

func TestRepublisherRetryAfter(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d})
	// Larger than the 100 ms backoff: honoured.
	if _, err := r.Middleware(failWith(middleware.RetryAfter(errors.New("429"), 3*time.Second)))(attemptMsg(1, "p")); err != nil {
		t.Fatal(err)
	}
	// Smaller than the 400 ms backoff after attempt 3: the backoff wins.
	if _, err := r.Middleware(failWith(middleware.RetryAfter(errors.New("429"), 50*time.Millisecond)))(attemptMsg(3, "p")); err != nil {
		t.Fatal(err)
	}
	// Through the Classifier the delay travels in the ClassifiedError.
	chain := r.Middleware(middleware.DefaultClassifier.Middleware(failWith(middleware.RetryAfter(errors.New("503"), 1500*time.Millisecond))))
	if _, err := chain(attemptMsg(1, "p")); err != nil {
		t.Fatal(err)
	}
	calls := d.Calls()
	if len(calls) != 3 {
		t.Fatalf("%d calls", len(calls))
	}
	for i, want := range []time.Duration{3 * time.Second, 400 * time.Millisecond, 1500 * time.Millisecond} {
		if calls[i].delay != want {
			t.Errorf("call %d: delay %v, want %v", i, calls[i].delay, want)
		}
	}
	if got := calls[0].msg.Metadata.Get(middleware.DelayKey); got != "3000" {
		t.Errorf("DelayKey %q, want 3000", got)
	}
	if got := calls[0].msg.Metadata.Get(middleware.ErrorClassKey); got != middleware.ClassRetryAfter {
		t.Errorf("class %q", got)
	}
	if got := calls[1].msg.Metadata.Get(middleware.ErrorClassKey); got != middleware.ClassRetryAfter {
		t.Errorf("class %q", got)
	}
	if d, ok := r.Delay(1, 5*time.Second); !ok || d != 5*time.Second {
		t.Errorf("Delay(1, 5s) = %v, %v", d, ok)
	}
	if d, ok := r.Delay(2, 0); !ok || d != 200*time.Millisecond {
		t.Errorf("Delay(2, 0) = %v, %v", d, ok)
	}
}

func TestRepublisherPassesNonRetryErrors(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d})
	for _, herr := range []error{
		middleware.Permanent(errors.New("bad")),
		jsonSyntaxErr(t),
		&middleware.ClassifiedError{Err: errors.New("x"), Classification: middleware.Classification{Action: middleware.ActionPoison, Class: "custom"}},
	} {
		out, err := r.Middleware(func(*message.Message) ([]*message.Message, error) {
			return []*message.Message{newMsg("x")}, herr
		})(attemptMsg(1, "p"))
		if err != herr || out != nil {
			t.Errorf("%v: got %v, %v; want the error unchanged and no output", herr, out, err)
		}
	}
	if len(d.Calls()) != 0 {
		t.Fatalf("Delayer called for non-retryable errors")
	}
	// Success passes produced messages through.
	produced := []*message.Message{newMsg("x")}
	out, err := r.Middleware(func(*message.Message) ([]*message.Message, error) { return produced, nil })(attemptMsg(1, "p"))
	if err != nil || len(out) != 1 || out[0] != produced[0] {
		t.Fatalf("success: %v, %v", out, err)
	}
}

func TestRepublisherAttemptFromMetadataWithoutCounter(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, MaxAttempts: 4})
	msg := ownCopy(newMsg("p"))
	msg.Metadata.Set(middleware.AttemptKey, "3")
	if _, err := r.Middleware(failWith(errors.New("x")))(msg); err != nil {
		t.Fatal(err)
	}
	if got := d.Calls()[0].msg.Metadata.Get(middleware.AttemptKey); got != "4" {
		t.Fatalf("attempt %q, want 4", got)
	}
	msg.Metadata.Set(middleware.AttemptKey, "4")
	var ex *chainerr.ExhaustedError
	if _, err := r.Middleware(failWith(errors.New("x")))(msg); !errors.As(err, &ex) {
		t.Fatalf("attempt 4 of 4: %v", err)
	}
}

func TestRepublisherErrorText(t *testing.T) {
	d := &recordingDelayer{}
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, ErrorText: func(err error) string {
		return strings.ReplaceAll(err.Error(), "s3cr3t", "***")
	}})
	if _, err := r.Middleware(failWith(errors.New("dial amqp://user:s3cr3t@host")))(attemptMsg(1, "p")); err != nil {
		t.Fatal(err)
	}
	if got := d.Calls()[0].msg.Metadata.Get(middleware.LastErrorKey); got != "dial amqp://user:***@host" {
		t.Fatalf("last error %q", got)
	}

	d2 := &recordingDelayer{}
	r2 := newRepublisher(t, middleware.RepublisherConfig{Delayer: d2})
	if _, err := r2.Middleware(failWith(errors.New(strings.Repeat("e", 5000))))(attemptMsg(1, "p")); err != nil {
		t.Fatal(err)
	}
	got := d2.Calls()[0].msg.Metadata.Get(middleware.LastErrorKey)
	if len(got) != retrymeta.DefaultMaxErrorBytes || !strings.HasSuffix(got, "…") {
		t.Fatalf("default error text is %d bytes, want %d ending in …", len(got), retrymeta.DefaultMaxErrorBytes)
	}
}

func TestTruncate(t *testing.T) {
	tests := []struct {
		s    string
		max  int
		want string
	}{
		{"hello", 0, "hello"},
		{"hello", -1, "hello"},
		{"hello", 5, "hello"},
		{"hello", 10, "hello"},
		{"hello world", 8, "hello…"},
		{"héllo", 5, "h…"}, // "é" is 2 bytes: cut on a rune boundary
		{"hello", 3, "…"},
		{"hello", 2, "he"},
		{"éé", 1, ""},
	}
	for _, tc := range tests {
		got := retrymeta.Truncate(tc.s, tc.max)
		if got != tc.want {
			t.Errorf("Truncate(%q, %d) = %q, want %q", tc.s, tc.max, got, tc.want)
		}
		if tc.max > 0 && len(got) > tc.max {
			t.Errorf("Truncate(%q, %d) = %d bytes, over the limit", tc.s, tc.max, len(got))
		}
	}
	if got := retrymeta.ErrorText(errors.New("abcdef"), 5); got != "ab…" {
		t.Errorf("ErrorText = %q", got)
	}
}

func TestRepublisherConfigValidate(t *testing.T) {
	d := &recordingDelayer{}
	tests := []struct {
		name string
		cfg  middleware.RepublisherConfig
		want string // "" = valid
	}{
		{"zero max attempts means default", middleware.RepublisherConfig{Delayer: d}, ""},
		{"max attempts 1", middleware.RepublisherConfig{Delayer: d, MaxAttempts: 1}, ""},
		{"max attempts cap", middleware.RepublisherConfig{Delayer: d, MaxAttempts: middleware.MaxAttemptsCap}, ""},
		{"negative max attempts", middleware.RepublisherConfig{Delayer: d, MaxAttempts: -1}, "MaxAttempts"},
		{"max attempts above cap", middleware.RepublisherConfig{Delayer: d, MaxAttempts: 1001}, "MaxAttempts"},
		{"nil delayer", middleware.RepublisherConfig{MaxAttempts: 3}, "Delayer"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := middleware.NewRepublisher(tc.cfg)
			if tc.want == "" {
				if err != nil || r == nil {
					t.Fatalf("NewRepublisher: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewRepublisher error %v, want one naming %q", err, tc.want)
			}
		})
	}
	r, err := middleware.NewRepublisher(middleware.RepublisherConfig{Delayer: d})
	if err != nil || r.MaxAttempts() != 5 {
		t.Fatalf("default MaxAttempts: %v %v", r, err)
	}
	// Validate itself (before defaults) rejects 0.
	if err := (middleware.RepublisherConfig{Delayer: d}).Validate(); err == nil {
		t.Error("Validate accepted MaxAttempts 0 without defaults")
	}
}

func TestDelayerFunc(t *testing.T) {
	var got time.Duration
	var f middleware.Delayer = testkit.DelayerFunc(func(_ context.Context, _ *message.Message, d time.Duration) error {
		got = d
		return nil
	})
	if err := f.Schedule(context.Background(), newMsg("p"), time.Second); err != nil || got != time.Second {
		t.Fatalf("%v %v", err, got)
	}
}

// A Delayer that answers ErrDeadLetter hands the retry to the broker: the
// republisher returns *DeadLetterRetryError (so the message is nacked), the
// observer counts a scheduled retry, and the poison forwarder's default
// decision leaves it alone.
func TestRepublisherDeadLetterRetry(t *testing.T) {
	var scheduled int
	obs := &countingObserver{onScheduled: func() { scheduled++ }}
	rep, err := middleware.NewRepublisher(middleware.RepublisherConfig{
		Delayer: testkit.DelayerFunc(func(context.Context, *message.Message, time.Duration) error {
			return fmt.Errorf("wrapped: %w", chainerr.ErrDeadLetter)
		}),
		Observer: obs,
	})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("u1", []byte("x"))
	_, herr := rep.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("dependency down")
	})(msg)
	var dl *chainerr.DeadLetterRetryError
	if !errors.As(herr, &dl) || dl.Attempt != 1 {
		t.Fatalf("err = %v, want *DeadLetterRetryError for attempt 1", herr)
	}
	if scheduled != 1 {
		t.Errorf("RetryScheduled called %d times, want 1", scheduled)
	}
	if middleware.DefaultShouldPoison(herr) {
		t.Error("the poison forwarder would poison a dead-letter retry")
	}
}

type countingObserver struct {
	middleware.NopObserver
	onScheduled func()
}

func (o *countingObserver) RetryScheduled(*message.Message, int, time.Duration, time.Duration) {
	o.onScheduled()
}

// The "Retry scheduled" log shows the delay asked and the one the Delayer
// waits (amqpretry's tiers round a delay to the nearest tier).
func TestRepublisherLogsScheduledDelay(t *testing.T) {
	logger := watermill.NewCaptureLogger()
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: planningDelayer{}, MaxAttempts: 5, Logger: logger,
		Backoff: exactBackoff(3 * time.Second)})
	if _, err := r.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("down")
	})(attemptMsg(1, "x")); err != nil {
		t.Fatal(err)
	}
	for _, m := range logger.Captured()[watermill.InfoLogLevel] {
		if m.Msg == "Retry scheduled" {
			if m.Fields["delay"] != "3s" || m.Fields["scheduled_delay"] != "4s" {
				t.Fatalf("log fields %v, want delay 3s and scheduled_delay 4s", m.Fields)
			}
			return
		}
	}
	t.Fatalf("no \"Retry scheduled\" log: %v", logger.Captured())
}

// planningDelayer holds nothing and plans every delay as 4 s.
type planningDelayer struct{}

func (planningDelayer) Schedule(context.Context, *message.Message, time.Duration) error { return nil }
func (planningDelayer) PlannedDelay(context.Context, time.Duration) time.Duration {
	return 4 * time.Second
}
