package metrics_test

import (
	"context"
	"errors"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/metrics"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

const (
	topic      = "orders"
	retryDelay = 10 * time.Millisecond
	raDelay    = 30 * time.Millisecond
	kindKey    = "kind"
)

// harness runs a router with the retry chain and the metrics middleware
// over gochannel.
type harness struct {
	t       *testing.T
	reg     *prometheus.Registry
	m       *metrics.Metrics
	pubsub  *gochannel.GoChannel
	delayer *middleware.MemoryDelayer
	router  *message.Router
	done    chan struct{}

	mu    sync.Mutex
	calls map[string]int // handler calls per message UUID
}

type harnessOpts struct {
	delayer func(d *middleware.MemoryDelayer) middleware.Delayer
	poison  func(p message.Publisher) message.Publisher
}

func newHarness(t *testing.T, opts harnessOpts) *harness {
	t.Helper()
	logger := watermill.NopLogger{}
	h := &harness{t: t, reg: prometheus.NewRegistry(), calls: map[string]int{}, done: make(chan struct{})}
	var err error
	h.m, err = metrics.New(metrics.Config{Registerer: h.reg})
	if err != nil {
		t.Fatal(err)
	}
	h.pubsub = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger)
	poisonPS := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	t.Cleanup(func() { _ = poisonPS.Close() })
	h.delayer, err = middleware.NewMemoryDelayer(h.pubsub, nil, logger)
	if err != nil {
		t.Fatal(err)
	}
	var delayer middleware.Delayer = h.delayer
	if opts.delayer != nil {
		delayer = opts.delayer(h.delayer)
	}
	var poisonPub message.Publisher = poisonPS
	if opts.poison != nil {
		poisonPub = opts.poison(poisonPS)
	}
	chain, err := router.New(router.Config{
		Delayer:         delayer,
		PoisonPublisher: poisonPub,
		Policy:          router.Policy{MaxAttempts: 3, FallbackPause: 5 * time.Millisecond, Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(retryDelay) }, Observer: h.m.Observer()},
		Logger:          logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	h.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	h.router.AddMiddleware(chain.Middleware, h.m.Middleware)
	h.router.AddConsumerHandler("orders-handler", topic, h.pubsub, h.handle)
	go func() {
		defer close(h.done)
		if err := h.router.Run(context.Background()); err != nil {
			t.Errorf("router.Run: %v", err)
		}
	}()
	select {
	case <-h.router.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(h.stop)
	return h
}

var errTransient = errors.New("downstream unavailable")

// handle fails or succeeds by the message's kind and call number.
func (h *harness) handle(msg *message.Message) error {
	h.mu.Lock()
	h.calls[msg.UUID]++
	n := h.calls[msg.UUID]
	h.mu.Unlock()
	switch kind := msg.Metadata.Get(kindKey); kind {
	case "ok":
		return nil
	case "flaky": // fails on the first call only
		if n == 1 {
			return errTransient
		}
		return nil
	case "flaky2": // fails on the first two calls
		if n <= 2 {
			return errTransient
		}
		return nil
	case "retry-after": // asks for a longer delay once
		if n == 1 {
			return middleware.RetryAfter(errTransient, raDelay)
		}
		return nil
	case "permanent":
		return middleware.Permanent(errors.New("order rejected"))
	case "always":
		return errTransient
	case "drop":
		return middleware.Drop(errors.New("order obsolete"))
	default:
		h.t.Errorf("unknown kind %q", kind)
		return nil
	}
}

func (h *harness) publish(kind string, n int) {
	h.t.Helper()
	for range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		msg.Metadata.Set(kindKey, kind)
		if err := h.pubsub.Publish(topic, msg); err != nil {
			h.t.Fatal(err)
		}
	}
}

// stop closes the router (waiting for running handlers) and the delayer.
// It is idempotent.
func (h *harness) stop() {
	if err := h.router.Close(); err != nil {
		h.t.Errorf("router.Close: %v", err)
	}
	<-h.done
	if err := h.delayer.Close(); err != nil {
		h.t.Errorf("delayer.Close: %v", err)
	}
	_ = h.pubsub.Close()
}

// waitFor polls cond until it holds or the deadline passes.
func (h *harness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.NewTimer(20 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			h.t.Fatalf("timed out waiting for %s", what)
		case <-tick.C:
		}
	}
}

// family returns the gathered metric family name, or nil.
func family(t *testing.T, g prometheus.Gatherer, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	return nil
}

func matches(m *dto.Metric, labels []string) bool {
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	if len(m.GetLabel()) != len(want) {
		return false
	}
	for _, lp := range m.GetLabel() {
		if v, ok := want[lp.GetName()]; !ok || v != lp.GetValue() {
			return false
		}
	}
	return true
}

// counter returns the value of the counter series name{labels...}, 0 when
// absent.
func counter(t *testing.T, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mf := family(t, g, name)
	if mf == nil {
		return 0
	}
	for _, m := range mf.GetMetric() {
		if matches(m, labels) {
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// sum returns the sum of all series of the counter name.
func sum(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mf := family(t, g, name)
	var s float64
	for _, m := range mf.GetMetric() {
		s += m.GetCounter().GetValue()
	}
	return s
}

// histogram returns the histogram series name{labels...} (t fails when
// absent).
func histogram(t *testing.T, g prometheus.Gatherer, name string, labels ...string) *dto.Histogram {
	t.Helper()
	mf := family(t, g, name)
	if mf == nil {
		t.Fatalf("no metric %s", name)
	}
	for _, m := range mf.GetMetric() {
		if matches(m, labels) {
			return m.GetHistogram()
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return nil
}

// cumulative returns the cumulative count of bucket le of h.
func cumulative(t *testing.T, h *dto.Histogram, le float64) uint64 {
	t.Helper()
	for _, b := range h.GetBucket() {
		if b.GetUpperBound() == le {
			return b.GetCumulativeCount()
		}
	}
	t.Fatalf("no bucket le=%g", le)
	return 0
}

func TestChainCounts(t *testing.T) {
	h := newHarness(t, harnessOpts{})

	// A deterministic mix of 14 messages.
	const (
		nOK         = 5 // succeed on attempt 1
		nFlaky      = 3 // fail on attempt 1, succeed on attempt 2 (10ms tier)
		nRetryAfter = 1 // RetryAfter 30ms on attempt 1, succeed on attempt 2
		nPermanent  = 2 // poisoned on attempt 1, class "permanent"
		nAlways     = 2 // fail 3 attempts, poisoned as "exhausted"
		nDrop       = 1 // dropped on attempt 1
	)
	h.publish("ok", nOK)
	h.publish("flaky", nFlaky)
	h.publish("retry-after", nRetryAfter)
	h.publish("permanent", nPermanent)
	h.publish("always", nAlways)
	h.publish("drop", nDrop)

	const (
		wantSuccess   = nOK + nFlaky + nRetryAfter                                   // 9
		wantError     = nFlaky + nRetryAfter + nPermanent + 3*nAlways + nDrop        // 13
		wantScheduled = nFlaky + nRetryAfter + 2*nAlways                             // 8
		wantPoisoned  = nPermanent + nAlways                                         // 4
		wantAttempt1  = nOK + nFlaky + nRetryAfter + nPermanent + nAlways + nDrop    // 14
		wantAttempt2  = nFlaky + nRetryAfter + nAlways                               // 6
		wantAttempt3  = nAlways                                                      // 2
		wantAttemptSu = 1*wantAttempt1 + 2*wantAttempt2 + 3*wantAttempt3             // 32
		wantDelaySum  = float64(nFlaky+2*nAlways)*0.010 + float64(nRetryAfter)*0.030 // 0.1
	)

	const (
		attempts  = "rabbitretry_attempts_total"
		scheduled = "rabbitretry_retries_scheduled_total"
		poisoned  = "rabbitretry_poisoned_total"
		dropped   = "rabbitretry_dropped_total"
	)
	h.waitFor("all messages to settle", func() bool {
		return counter(t, h.reg, attempts, "queue", topic, "outcome", "success") >= wantSuccess &&
			counter(t, h.reg, attempts, "queue", topic, "outcome", "error") >= wantError &&
			sum(t, h.reg, poisoned) >= wantPoisoned &&
			sum(t, h.reg, dropped) >= nDrop &&
			sum(t, h.reg, scheduled) >= wantScheduled &&
			h.delayer.Pending() == 0
	})
	h.stop() // nothing in flight from here on

	// Every counter, exactly: the full exposition of the counters.
	const wantCounters = `
# HELP rabbitretry_attempts_total Handler attempts, by queue and outcome ("success" or "error").
# TYPE rabbitretry_attempts_total counter
rabbitretry_attempts_total{outcome="error",queue="orders"} 13
rabbitretry_attempts_total{outcome="success",queue="orders"} 9
# HELP rabbitretry_dropped_total Messages acked and discarded on a drop verdict.
# TYPE rabbitretry_dropped_total counter
rabbitretry_dropped_total{queue="orders"} 1
# HELP rabbitretry_poisoned_total Messages confirmed into the poison queue, by queue and error class.
# TYPE rabbitretry_poisoned_total counter
rabbitretry_poisoned_total{class="exhausted",queue="orders"} 2
rabbitretry_poisoned_total{class="permanent",queue="orders"} 2
# HELP rabbitretry_retries_scheduled_total Retries held by the Delayer (publish confirmed), by queue and delay tier.
# TYPE rabbitretry_retries_scheduled_total counter
rabbitretry_retries_scheduled_total{queue="orders",tier="10ms"} 7
rabbitretry_retries_scheduled_total{queue="orders",tier="30ms"} 1
`
	if err := testutil.GatherAndCompare(h.reg, strings.NewReader(wantCounters),
		attempts, dropped, poisoned, scheduled,
		"rabbitretry_retry_failures_total", "rabbitretry_poison_failures_total"); err != nil {
		t.Error(err)
	}
	// No failure series at all.
	for _, name := range []string{"rabbitretry_retry_failures_total", "rabbitretry_poison_failures_total"} {
		if n, err := testutil.GatherAndCount(h.reg, name); err != nil || n != 0 {
			t.Errorf("%s: %d series (err %v), want 0", name, n, err)
		}
	}

	// Histograms.
	an := histogram(t, h.reg, "rabbitretry_attempt_number", "queue", topic)
	if an.GetSampleCount() != wantSuccess+wantError || an.GetSampleSum() != wantAttemptSu {
		t.Errorf("attempt_number count=%d sum=%g, want %d and %d", an.GetSampleCount(), an.GetSampleSum(), wantSuccess+wantError, wantAttemptSu)
	}
	for le, want := range map[float64]uint64{1: wantAttempt1, 2: wantAttempt1 + wantAttempt2, 3: wantAttempt1 + wantAttempt2 + wantAttempt3, 21: wantSuccess + wantError} {
		if got := cumulative(t, an, le); got != want {
			t.Errorf("attempt_number bucket le=%g: %d, want %d", le, got, want)
		}
	}
	rd := histogram(t, h.reg, "rabbitretry_retry_delay_seconds", "queue", topic)
	if rd.GetSampleCount() != wantScheduled || math.Abs(rd.GetSampleSum()-wantDelaySum) > 1e-9 {
		t.Errorf("retry_delay_seconds count=%d sum=%g, want %d and %g", rd.GetSampleCount(), rd.GetSampleSum(), wantScheduled, wantDelaySum)
	}
	rp := histogram(t, h.reg, "rabbitretry_republish_seconds", "queue", topic)
	if rp.GetSampleCount() != wantScheduled || rp.GetSampleSum() < 0 {
		t.Errorf("republish_seconds count=%d sum=%g, want %d and >= 0", rp.GetSampleCount(), rp.GetSampleSum(), wantScheduled)
	}
	// One series per (metric, label set) above: 2 + 1 + 2 + 2 + 3 histograms.
	if n, err := testutil.GatherAndCount(h.reg); err != nil || n != 10 {
		t.Errorf("registry has %d series (err %v), want 10", n, err)
	}

	// Handler calls agree with attempts_total.
	var calls int
	h.mu.Lock()
	for _, n := range h.calls {
		calls += n
	}
	h.mu.Unlock()
	if calls != wantSuccess+wantError {
		t.Errorf("handler called %d times, want %d", calls, wantSuccess+wantError)
	}
}

// failOnce fails the first call of fn with err.
type failOnce struct{ failed atomic.Bool }

func (f *failOnce) first() bool { return f.failed.CompareAndSwap(false, true) }

type failingPublisher struct {
	message.Publisher
	once failOnce
}

func (p *failingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.once.first() {
		return errors.New("poison broker unavailable")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// TestChainFailures: the first retry schedule and the first poison publish
// fail; the fallback copies them straight back (the retry as attempt 2, the
// refused poison copy past the last attempt, so its handler does not run
// again) and they then go through.
func TestChainFailures(t *testing.T) {
	var schedule failOnce
	h := newHarness(t, harnessOpts{
		delayer: func(d *middleware.MemoryDelayer) middleware.Delayer {
			return testkit.DelayerFunc(func(ctx context.Context, msg *message.Message, delay time.Duration) error {
				if schedule.first() {
					return errors.New("wait queue unavailable")
				}
				return d.Schedule(ctx, msg, delay)
			})
		},
		poison: func(p message.Publisher) message.Publisher { return &failingPublisher{Publisher: p} },
	})
	h.publish("flaky2", 1)    // attempt 1 fails, schedule fails, fallback copy; attempt 2 fails, scheduled; attempt 3 succeeds
	h.publish("permanent", 1) // attempt 1, poison fails, fallback copy past the last attempt; poisoned without running

	h.waitFor("both messages to settle", func() bool {
		return counter(t, h.reg, "rabbitretry_attempts_total", "queue", topic, "outcome", "success") >= 1 &&
			counter(t, h.reg, "rabbitretry_attempts_total", "queue", topic, "outcome", "error") >= 3 &&
			counter(t, h.reg, "rabbitretry_poisoned_total", "queue", topic, "class", "permanent") >= 1 &&
			h.delayer.Pending() == 0
	})
	h.stop()

	const want = `
# HELP rabbitretry_attempts_total Handler attempts, by queue and outcome ("success" or "error").
# TYPE rabbitretry_attempts_total counter
rabbitretry_attempts_total{outcome="error",queue="orders"} 3
rabbitretry_attempts_total{outcome="success",queue="orders"} 1
# HELP rabbitretry_poison_failures_total Poison-queue publishes that failed; the message was nacked.
# TYPE rabbitretry_poison_failures_total counter
rabbitretry_poison_failures_total{queue="orders"} 1
# HELP rabbitretry_poisoned_total Messages confirmed into the poison queue, by queue and error class.
# TYPE rabbitretry_poisoned_total counter
rabbitretry_poisoned_total{class="permanent",queue="orders"} 1
# HELP rabbitretry_retries_scheduled_total Retries held by the Delayer (publish confirmed), by queue and delay tier.
# TYPE rabbitretry_retries_scheduled_total counter
rabbitretry_retries_scheduled_total{queue="orders",tier="10ms"} 1
# HELP rabbitretry_retry_failures_total Retries the Delayer could not hold; the message was nacked.
# TYPE rabbitretry_retry_failures_total counter
rabbitretry_retry_failures_total{queue="orders"} 1
`
	if err := testutil.GatherAndCompare(h.reg, strings.NewReader(want),
		"rabbitretry_attempts_total", "rabbitretry_poison_failures_total", "rabbitretry_poisoned_total",
		"rabbitretry_retries_scheduled_total", "rabbitretry_retry_failures_total", "rabbitretry_dropped_total"); err != nil {
		t.Error(err)
	}
	an := histogram(t, h.reg, "rabbitretry_attempt_number", "queue", topic)
	if an.GetSampleCount() != 4 || an.GetSampleSum() != 7 { // attempts 1,2,3 and 1 (the parked copy does not run)
		t.Errorf("attempt_number count=%d sum=%g, want 4 and 7", an.GetSampleCount(), an.GetSampleSum())
	}
}

func TestNewTwiceOnOneRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := metrics.New(metrics.Config{Registerer: reg}); err != nil {
		t.Fatal(err)
	}
	_, err := metrics.New(metrics.Config{Registerer: reg})
	if err == nil {
		t.Fatal("second New on the same registry: no error")
	}
	var are prometheus.AlreadyRegisteredError
	if !errors.As(err, &are) {
		t.Errorf("error %v is not a prometheus.AlreadyRegisteredError", err)
	}
	if !strings.Contains(err.Error(), "rabbitretry_attempts_total") || !strings.Contains(err.Error(), "already registered") {
		t.Errorf("error %q does not name the metric", err)
	}
	// Another namespace on the same registry is fine.
	if _, err := metrics.New(metrics.Config{Registerer: reg, Namespace: "other"}); err != nil {
		t.Errorf("New with another namespace: %v", err)
	}
}

// failingRegisterer fails the registration of the collector describing
// failName and remembers what is registered.
type failingRegisterer struct {
	failName   string
	registered map[prometheus.Collector]bool
}

func (f *failingRegisterer) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 10)
	c.Describe(ch)
	close(ch)
	for d := range ch {
		if strings.Contains(d.String(), `"`+f.failName+`"`) {
			return errors.New("refused")
		}
	}
	f.registered[c] = true
	return nil
}

func (f *failingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := f.Register(c); err != nil {
			panic(err)
		}
	}
}

func (f *failingRegisterer) Unregister(c prometheus.Collector) bool {
	ok := f.registered[c]
	delete(f.registered, c)
	return ok
}

// A failed New leaves nothing registered.
func TestNewRollsBackOnError(t *testing.T) {
	reg := &failingRegisterer{failName: "rabbitretry_dropped_total", registered: map[prometheus.Collector]bool{}}
	_, err := metrics.New(metrics.Config{Registerer: reg})
	if err == nil || !strings.Contains(err.Error(), "rabbitretry_dropped_total") || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("New: %v, want an error naming rabbitretry_dropped_total and wrapping the cause", err)
	}
	if len(reg.registered) != 0 {
		t.Errorf("%d collectors left registered after the failed New", len(reg.registered))
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  metrics.Config
		want string // substring of the error; "" means valid
	}{
		{"zero", metrics.Config{}, ""},
		{"namespace", metrics.Config{Namespace: "my_app"}, ""},
		{"bad namespace", metrics.Config{Namespace: "my-app"}, "Namespace"},
		{"bad namespace digit", metrics.Config{Namespace: "1app"}, "Namespace"},
		{"delay buckets", metrics.Config{DelayBuckets: []float64{1, 10, 60}}, ""},
		{"delay buckets unsorted", metrics.Config{DelayBuckets: []float64{1, 10, 5}}, "DelayBuckets"},
		{"latency buckets duplicate", metrics.Config{LatencyBuckets: []float64{0.1, 0.1}}, "LatencyBuckets"},
		{"latency buckets NaN", metrics.Config{LatencyBuckets: []float64{math.NaN()}}, "LatencyBuckets"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				tc.cfg.Registerer = prometheus.NewRegistry()
				if _, err := metrics.New(tc.cfg); err != nil {
					t.Fatalf("New: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate: %v, want an error about %s", err, tc.want)
			}
			tc.cfg.Registerer = prometheus.NewRegistry()
			if _, err := metrics.New(tc.cfg); err == nil {
				t.Fatal("New accepted an invalid config")
			}
		})
	}
}

type queueKey struct{}

// The observer methods called directly: queue fallbacks, Tier, buckets.
func TestObserverDirect(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(metrics.Config{
		Registerer: reg,
		Namespace:  "app",
		QueueName: func(ctx context.Context) string {
			q, _ := ctx.Value(queueKey{}).(string)
			return q
		},
		Tier: func(d time.Duration) time.Duration { // two tiers: 1s and 1m
			if d <= time.Second {
				return time.Second
			}
			return time.Minute
		},
		DelayBuckets:   []float64{1, 60},
		LatencyBuckets: []float64{0.01},
	})
	if err != nil {
		t.Fatal(err)
	}
	routed := message.NewMessage("1", nil)
	routed.SetContext(context.WithValue(context.Background(), queueKey{}, "q1"))
	fromMeta := message.NewMessage("2", nil)
	fromMeta.Metadata.Set(middleware.OriginalQueueKey, "q2")
	bare := message.NewMessage("3", nil)

	obs := m.Observer()
	obs.RetryScheduled(routed, 1, 300*time.Millisecond, 2*time.Millisecond)
	obs.RetryScheduled(routed, 2, 5*time.Second, 20*time.Millisecond)
	obs.RetryScheduled(fromMeta, 1, time.Second, time.Millisecond)
	obs.RetryFailed(bare, 1, errors.New("x"))
	obs.Poisoned(routed, 3, middleware.ClassExhausted)
	obs.Poisoned(fromMeta, 1, "")
	obs.PoisonFailed(fromMeta, 1, errors.New("x"))
	obs.Dropped(bare, 1)
	obs.Dropped(routed, 2)

	const want = `
# HELP app_dropped_total Messages acked and discarded on a drop verdict.
# TYPE app_dropped_total counter
app_dropped_total{queue="q1"} 1
app_dropped_total{queue="unknown"} 1
# HELP app_poison_failures_total Poison-queue publishes that failed; the message was nacked.
# TYPE app_poison_failures_total counter
app_poison_failures_total{queue="q2"} 1
# HELP app_poisoned_total Messages confirmed into the poison queue, by queue and error class.
# TYPE app_poisoned_total counter
app_poisoned_total{class="exhausted",queue="q1"} 1
app_poisoned_total{class="unknown",queue="q2"} 1
# HELP app_retries_scheduled_total Retries held by the Delayer (publish confirmed), by queue and delay tier.
# TYPE app_retries_scheduled_total counter
app_retries_scheduled_total{queue="q1",tier="1m"} 1
app_retries_scheduled_total{queue="q1",tier="1s"} 1
app_retries_scheduled_total{queue="q2",tier="1s"} 1
# HELP app_retry_failures_total Retries the Delayer could not hold; the message was nacked.
# TYPE app_retry_failures_total counter
app_retry_failures_total{queue="unknown"} 1
# HELP app_retry_delay_seconds Delay requested for each scheduled retry, in seconds.
# TYPE app_retry_delay_seconds histogram
app_retry_delay_seconds_bucket{queue="q1",le="1"} 1
app_retry_delay_seconds_bucket{queue="q1",le="60"} 2
app_retry_delay_seconds_bucket{queue="q1",le="+Inf"} 2
app_retry_delay_seconds_sum{queue="q1"} 5.3
app_retry_delay_seconds_count{queue="q1"} 2
app_retry_delay_seconds_bucket{queue="q2",le="1"} 1
app_retry_delay_seconds_bucket{queue="q2",le="60"} 1
app_retry_delay_seconds_bucket{queue="q2",le="+Inf"} 1
app_retry_delay_seconds_sum{queue="q2"} 1
app_retry_delay_seconds_count{queue="q2"} 1
# HELP app_republish_seconds Time the Delayer took to hold a retry copy (publish and confirm), in seconds.
# TYPE app_republish_seconds histogram
app_republish_seconds_bucket{queue="q1",le="0.01"} 1
app_republish_seconds_bucket{queue="q1",le="+Inf"} 2
app_republish_seconds_sum{queue="q1"} 0.022
app_republish_seconds_count{queue="q1"} 2
app_republish_seconds_bucket{queue="q2",le="0.01"} 1
app_republish_seconds_bucket{queue="q2",le="+Inf"} 1
app_republish_seconds_sum{queue="q2"} 0.001
app_republish_seconds_count{queue="q2"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Error(err)
	}
}

// Middleware outside a router: queue fallback, attempt from metadata, panics
// count as errors.
func TestMiddlewareDirect(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ok := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	fail := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errTransient })
	boom := m.Middleware(func(*message.Message) ([]*message.Message, error) { panic("boom") })

	msg := message.NewMessage("1", nil)
	msg.Metadata.Set(middleware.AttemptKey, "4")
	msg.Metadata.Set(middleware.OriginalQueueKey, "q")
	if _, err := ok(msg); err != nil {
		t.Fatal(err)
	}
	if _, err := fail(message.NewMessage("2", nil)); !errors.Is(err, errTransient) {
		t.Fatalf("error %v not passed on", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("recovered %v, want the handler's panic", r)
			}
		}()
		_, _ = boom(message.NewMessage("3", nil))
	}()

	const want = `
# HELP rabbitretry_attempts_total Handler attempts, by queue and outcome ("success" or "error").
# TYPE rabbitretry_attempts_total counter
rabbitretry_attempts_total{outcome="error",queue="unknown"} 2
rabbitretry_attempts_total{outcome="success",queue="q"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "rabbitretry_attempts_total"); err != nil {
		t.Error(err)
	}
	if got := histogram(t, reg, "rabbitretry_attempt_number", "queue", "q").GetSampleSum(); got != 4 {
		t.Errorf("attempt_number for q: sum %g, want 4", got)
	}
}

// Descriptions names exactly what New registers.
func TestDescriptions(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(metrics.Config{Registerer: reg, Namespace: "ns"})
	if err != nil {
		t.Fatal(err)
	}
	// Make one series of each metric so that Gather returns them.
	msg := message.NewMessage("1", nil)
	_, _ = m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg)
	obs := m.Observer()
	obs.RetryScheduled(msg, 1, time.Second, time.Millisecond)
	obs.RetryFailed(msg, 1, errTransient)
	obs.Poisoned(msg, 1, "permanent")
	obs.PoisonFailed(msg, 1, errTransient)
	obs.Dropped(msg, 1)
	obs.(middleware.PauseObserver).PauseStarted("dependency-unavailable")
	obs.(middleware.PauseObserver).PauseEnded(time.Second)
	obs.(middleware.RouteObserver).RouteChecked("q", "dead-letter-first", "policy drift")

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		got[mf.GetName()] = mf
	}
	ds := metrics.Descriptions("ns")
	if len(ds) != len(got) {
		t.Errorf("%d descriptions, %d registered metrics", len(ds), len(got))
	}
	for _, d := range ds {
		mf, ok := got[d.Name]
		if !ok {
			t.Errorf("%s described but not registered", d.Name)
			continue
		}
		if strings.ToLower(mf.GetType().String()) != d.Type || mf.GetHelp() != d.Help {
			t.Errorf("%s: registered %s %q, described %s %q", d.Name, mf.GetType(), mf.GetHelp(), d.Type, d.Help)
		}
		var names []string
		for _, lp := range mf.GetMetric()[0].GetLabel() {
			names = append(names, lp.GetName())
		}
		want := append([]string(nil), d.Labels...)
		if strings.Join(sortedCopy(names), ",") != strings.Join(sortedCopy(want), ",") {
			t.Errorf("%s: labels %v, described %v", d.Name, names, d.Labels)
		}
	}
	if d := metrics.Descriptions(""); d[0].Name != "rabbitretry_attempts_total" {
		t.Errorf("default namespace: %s", d[0].Name)
	}
}

func sortedCopy(s []string) []string {
	c := slices.Clone(s)
	slices.Sort(c)
	return c
}

func TestFormatDelay(t *testing.T) {
	for d, want := range map[time.Duration]string{
		-time.Second:            "0ms",
		0:                       "0ms",
		250 * time.Millisecond:  "250ms",
		1500 * time.Millisecond: "1500ms",
		time.Second:             "1s",
		90 * time.Second:        "90s",
		5 * time.Minute:         "5m",
		2 * time.Hour:           "2h",
	} {
		if got := retrymeta.FormatDelay(d); got != want {
			t.Errorf("FormatDelay(%s) = %q, want %q", d, got, want)
		}
	}
}
