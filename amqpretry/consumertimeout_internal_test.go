package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

func TestEffectiveTimeout(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      timeoutInputs
		want    time.Duration
		assumed bool
	}{
		{"4.3 classic: none", timeoutInputs{version: "4.3.6", queueType: QueueTypeClassic, queueArg: int64(5000)}, 0, false},
		{"4.3 quorum: broker default assumed", timeoutInputs{version: "4.3.6", queueType: QueueTypeQuorum}, defaultBrokerConsumerTimeout, true},
		{"4.3 quorum: broker default given", timeoutInputs{version: "4.3.6", queueType: QueueTypeQuorum, brokerDefault: time.Hour}, time.Hour, false},
		{"4.3 quorum: broker has none", timeoutInputs{version: "4.3.6", queueType: QueueTypeQuorum, brokerDefault: -1}, 0, false},
		{"consumer argument wins", timeoutInputs{version: "4.3.6", queueType: QueueTypeQuorum, consumerArg: int32(90000), queueArg: int64(5000), policy: float64(4000)}, 90 * time.Second, false},
		{"queue argument below policy", timeoutInputs{version: "4.3.6", queueType: QueueTypeQuorum, queueArg: int64(5000), policy: float64(9000)}, 5 * time.Second, false},
		{"policy below queue argument", timeoutInputs{version: "4.3.6", queueType: QueueTypeQuorum, queueArg: int64(9000), policy: float64(4000)}, 4 * time.Second, false},
		{"policy alone (JSON number)", timeoutInputs{version: "4.2.1", queueType: QueueTypeClassic, policy: float64(60000)}, time.Minute, false},
		{"3.13 classic: queue argument", timeoutInputs{version: "3.13.7", queueType: QueueTypeClassic, queueArg: "7000"}, 7 * time.Second, false},
		{"3.10 ignores arguments", timeoutInputs{version: "3.10.8", queueType: QueueTypeClassic, queueArg: int64(5000), consumerArg: int64(5000)}, defaultBrokerConsumerTimeout, true},
		{"unknown version: arguments apply", timeoutInputs{queueType: QueueTypeClassic, queueArg: int64(5000)}, 5 * time.Second, false},
		{"bad values ignored", timeoutInputs{version: "4.3.6", queueType: QueueTypeQuorum, queueArg: "soon", policy: int64(-3), brokerDefault: time.Hour}, time.Hour, false},
	} {
		got := effectiveTimeout(tc.in)
		if got.timeout != tc.want || got.assumed != tc.assumed {
			t.Errorf("%s: got %v (assumed %v, %s), want %v (assumed %v)", tc.name, got.timeout, got.assumed, got.source, tc.want, tc.assumed)
		}
	}
}

func TestDeadlineFor(t *testing.T) {
	for _, tc := range []struct{ t, margin, want time.Duration }{
		{5 * time.Second, 0, 4 * time.Second},
		{30 * time.Minute, 0, 29 * time.Minute},
		{time.Minute, 0, 54 * time.Second},
		{time.Second, 0, 500 * time.Millisecond}, // never below half
		{time.Minute, 5 * time.Second, 55 * time.Second},
	} {
		if got := deadlineFor(tc.t, tc.margin); got != tc.want {
			t.Errorf("deadlineFor(%v, %v) = %v, want %v", tc.t, tc.margin, got, tc.want)
		}
	}
}

func TestHandlerDeadlineValidate(t *testing.T) {
	if err := (HandlerDeadline{Margin: -time.Second}).validate(); err == nil || !strings.Contains(err.Error(), "HandlerDeadline.Margin") {
		t.Errorf("negative Margin: %v", err)
	}
	if err := (HandlerDeadline{HandlerTimeout: -time.Second}).validate(); err == nil || !strings.Contains(err.Error(), "HandlerDeadline.HandlerTimeout") {
		t.Errorf("negative HandlerTimeout: %v", err)
	}
	if err := (HandlerDeadline{}).validate(); err != nil {
		t.Errorf("zero value: %v", err)
	}
}

// logRec records Error-level log messages and Info-level warnings.
type logRec struct {
	watermill.NopLogger
	mu   sync.Mutex
	errs []string
}

func (l *logRec) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, msg+": "+err.Error())
}

func (l *logRec) Info(msg string, f watermill.LogFields) {
	if strings.HasPrefix(msg, "Warning") {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.errs = append(l.errs, msg+": "+f["hint"].(string))
	}
}

func (l *logRec) all() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.errs, "\n")
}

// The startup warnings: a consumer timeout that cannot be determined, and
// a HandlerTimeout longer than the deadline.
func TestHandlerDeadlineWarnings(t *testing.T) {
	l := &logRec{}
	d := &deadlines{version: "4.3.6", queueType: QueueTypeQuorum, logger: l, entries: map[string]*deadlineEntry{},
		cfg: HandlerDeadline{HandlerTimeout: time.Hour}}
	if got := d.resolve("q"); got != 29*time.Minute {
		t.Errorf("deadline %v, want 29m", got)
	}
	logs := l.all()
	if !strings.Contains(logs, "cannot be determined") || !strings.Contains(logs, "BrokerConsumerTimeout") {
		t.Errorf("no warning that the consumer timeout cannot be determined:\n%s", logs)
	}
	if !strings.Contains(logs, "Configured handler timeout exceeds") || !strings.Contains(logs, "HandlerTimeout 1h0m0s") {
		t.Errorf("no warning that HandlerTimeout exceeds the deadline:\n%s", logs)
	}

	l = &logRec{}
	d = &deadlines{version: "4.3.6", queueType: QueueTypeQuorum, queueArg: int64(60000), logger: l, entries: map[string]*deadlineEntry{},
		cfg: HandlerDeadline{HandlerTimeout: 50 * time.Second}}
	if got := d.resolve("q"); got != 54*time.Second {
		t.Errorf("deadline %v, want 54s", got)
	}
	if logs := l.all(); logs != "" {
		t.Errorf("unexpected warnings:\n%s", logs)
	}
}

// wrap gives the handler a context with the deadline, counted from the
// chain's start, and restores the chain's context afterwards.
func TestDeadlineWrap(t *testing.T) {
	d := &deadlines{version: "4.3.6", queueType: QueueTypeQuorum, queueArg: int64(2000), logger: watermill.NopLogger{},
		entries: map[string]*deadlineEntry{}}
	msg := message.NewMessage("u", nil)
	markStart(msg)
	orig := msg.Context()
	start := time.Now()
	h := d.wrap(func(context.Context) string { return "q" }, func(m *message.Message) ([]*message.Message, error) {
		dl, ok := m.Context().Deadline()
		if !ok || dl.Sub(start) > time.Second+50*time.Millisecond {
			t.Errorf("handler deadline %v (set %v), want about 1 s from start", dl.Sub(start), ok)
		}
		<-m.Context().Done()
		return nil, m.Context().Err()
	})
	if _, err := h(msg); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("handler error %v, want DeadlineExceeded", err)
	}
	if msg.Context() != orig || orig.Err() != nil {
		t.Errorf("the chain's context was not restored")
	}
	var none *deadlines
	plain := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	if _, err := none.wrap(nil, plain)(msg); err != nil {
		t.Errorf("disabled: %v", err)
	}
}

// With a management API the policy is read from the queue record
// (?disable_stats=true) and read again once the cached value is older
// than deadlineRefresh: an operator's policy change reaches the deadline.
func TestDeadlineFollowsPolicy(t *testing.T) {
	var mu sync.Mutex
	policyMs := 10000
	var paths []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		paths = append(paths, r.URL.RequestURI())
		fmt.Fprintf(w, `{"type":"quorum","arguments":{"x-queue-type":"quorum"},"effective_policy_definition":{"consumer-timeout":%d}}`, policyMs)
	}))
	defer srv.Close()
	mc, err := newMgmtClient(&AdoptQueue{ManagementURL: "http://guest:guest@" + strings.TrimPrefix(srv.URL, "http://")}, "ManagementURL")
	if err != nil {
		t.Fatal(err)
	}
	d := &deadlines{version: "4.3.6", queueType: QueueTypeClassic, mgmt: mc, vhost: "/", logger: watermill.NopLogger{},
		entries: map[string]*deadlineEntry{}}
	if got := d.forQueue("q"); got != 9*time.Second {
		t.Fatalf("deadline %v, want 9s (policy 10 s, the queue record says quorum)", got)
	}
	mu.Lock()
	policyMs = 4000
	if len(paths) != 1 || paths[0] != "/api/queues/%2F/q?disable_stats=true" {
		t.Errorf("requests %v, want the queue record only", paths)
	}
	mu.Unlock()
	if got := d.forQueue("q"); got != 9*time.Second {
		t.Errorf("deadline %v before the refresh interval, want the cached 9s", got)
	}
	d.mu.Lock()
	d.entries["q"].at = time.Now().Add(-deadlineRefresh - time.Second)
	d.mu.Unlock()
	d.forQueue("q") // starts the refresh
	waitFor(t, 5*time.Second, "refreshed deadline", func() bool { return d.forQueue("q") == 3*time.Second })
}
