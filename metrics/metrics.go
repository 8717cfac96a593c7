package metrics

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// defaultNamespace is the metric name prefix used when Config.Namespace is
// empty.
const defaultNamespace = "rabbitretry"

// unknownQueue is the queue label value for a message whose queue neither
// Config.QueueName nor the "rabbitretry-original-queue" metadata names.
const unknownQueue = "unknown"

// Outcome label values of attempts_total.
const (
	outcomeSuccess = "success"
	outcomeError   = "error"
)

// defaultDelayBuckets are the retry_delay_seconds buckets, in seconds: from
// 100 ms to 1 h, covering retrymeta.DefaultBackoff (1 s doubling up to
// 5 min, ±50% jitter) and the usual wait-queue tiers.
func defaultDelayBuckets() []float64 {
	return []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600}
}

// defaultLatencyBuckets are the republish_seconds buckets, in seconds: from
// 0.5 ms to 10 s, for a publish with broker confirm.
func defaultLatencyBuckets() []float64 {
	return []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}
}

// attemptNumberBuckets are the fixed buckets of the attempt_number
// histogram.
func attemptNumberBuckets() []float64 {
	return []float64{1, 2, 3, 5, 8, 13, 21}
}

// Config configures Metrics. Zero values take the defaults.
type Config struct {
	// Namespace prefixes every metric name: "<Namespace>_attempts_total".
	// Default "rabbitretry". Must match
	// [a-zA-Z_][a-zA-Z0-9_]*.
	Namespace string
	// Registerer receives the collectors. Default
	// prometheus.DefaultRegisterer.
	Registerer prometheus.Registerer
	// QueueName names the queue label from the message's context (the
	// router's context, which the observer also receives). Default
	// message.SubscribeTopicFromCtx. When it returns "", the
	// "rabbitretry-original-queue" metadata is used, then "unknown". Use the
	// same function as router.Config.QueueName.
	QueueName func(ctx context.Context) string
	// Tier maps a requested retry delay to the delay tier that holds it, for
	// the tier label of retries_scheduled_total. Default: the delay rounded
	// to a millisecond. With a jittered backoff that makes many label values:
	// with amqpretry pass the topology's TierFor.
	Tier func(delay time.Duration) time.Duration
	// DelayBuckets are the retry_delay_seconds buckets, in seconds,
	// strictly increasing. Default: 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120,
	// 300, 600, 1800, 3600 (100 ms to 1 h).
	DelayBuckets []float64
	// LatencyBuckets are the republish_seconds buckets, in seconds,
	// strictly increasing. Default: 0.5 ms to 10 s in 14 buckets.
	LatencyBuckets []float64
}

var namespaceRE = regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)

func (c *Config) setDefaults() {
	if c.Namespace == "" {
		c.Namespace = defaultNamespace
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.DefaultRegisterer
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.Tier == nil {
		c.Tier = func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	}
	if len(c.DelayBuckets) == 0 {
		c.DelayBuckets = defaultDelayBuckets()
	}
	if len(c.LatencyBuckets) == 0 {
		c.LatencyBuckets = defaultLatencyBuckets()
	}
}

// Validate reports the first bad field. Zero values are valid (they take
// the defaults).
func (c Config) Validate() error {
	if c.Namespace != "" && !namespaceRE.MatchString(c.Namespace) {
		return fmt.Errorf("metrics.Config.Namespace %q does not match [a-zA-Z_][a-zA-Z0-9_]*", c.Namespace)
	}
	if err := checkBuckets(c.DelayBuckets); err != nil {
		return fmt.Errorf("metrics.Config.DelayBuckets: %w", err)
	}
	if err := checkBuckets(c.LatencyBuckets); err != nil {
		return fmt.Errorf("metrics.Config.LatencyBuckets: %w", err)
	}
	return nil
}

func checkBuckets(b []float64) error {
	for i, v := range b {
		if math.IsNaN(v) {
			return fmt.Errorf("bucket %d is NaN", i)
		}
		if i > 0 && v <= b[i-1] {
			return fmt.Errorf("buckets are not strictly increasing: %g after %g", v, b[i-1])
		}
	}
	return nil
}

// Metrics holds the collectors. Observer returns the middleware.Observer
// that counts what the retry chain did (pass it as router.Policy.Observer),
// and Middleware counts handler attempts. Its methods are safe for
// concurrent use.
type Metrics struct {
	queueName func(ctx context.Context) string
	tier      func(time.Duration) time.Duration

	attempts         *prometheus.CounterVec
	attemptNumber    *prometheus.HistogramVec
	retriesScheduled *prometheus.CounterVec
	retryDelay       *prometheus.HistogramVec
	republish        *prometheus.HistogramVec
	retryFailures    *prometheus.CounterVec
	poisoned         *prometheus.CounterVec
	poisonFailures   *prometheus.CounterVec
	dropped          *prometheus.CounterVec
	paused           *prometheus.GaugeVec
	pauses           *prometheus.CounterVec
	pausedSeconds    *prometheus.CounterVec
	routeInPlace     *prometheus.GaugeVec
	routeProblems    *prometheus.CounterVec
}

// observer is the middleware.Observer of a Metrics (Metrics.Observer).
type observer struct{ m *Metrics }

var (
	_ middleware.Observer      = observer{}
	_ middleware.PauseObserver = observer{}
	_ middleware.RouteObserver = observer{}
)

// description describes one metric.
type description struct {
	// Name is the full metric name, namespace included.
	Name string
	// Type is "counter", "gauge" or "histogram".
	Type string
	// Labels are the label names, in order.
	Labels []string
	// Help is the metric's HELP text.
	Help string
}

// Metric names without the namespace, in descriptions order.
const (
	nameAttempts         = "attempts_total"
	nameAttemptNumber    = "attempt_number"
	nameRetriesScheduled = "retries_scheduled_total"
	nameRetryDelay       = "retry_delay_seconds"
	nameRepublish        = "republish_seconds"
	nameRetryFailures    = "retry_failures_total"
	namePoisoned         = "poisoned_total"
	namePoisonFailures   = "poison_failures_total"
	nameDropped          = "dropped_total"
	namePaused           = "paused"
	namePauses           = "pauses_total"
	namePausedSeconds    = "paused_seconds_total"
	nameRouteInPlace     = "broker_route_in_place"
	nameRouteProblems    = "broker_route_problems_total"
)

type spec struct {
	name, typ string
	labels    []string
	help      string
}

var specs = []spec{
	{nameAttempts, "counter", []string{"queue", "outcome"},
		`Handler attempts, by queue and outcome ("success" or "error").`},
	{nameAttemptNumber, "histogram", []string{"queue"},
		"Attempt number (1 = first delivery) of each handled attempt."},
	{nameRetriesScheduled, "counter", []string{"queue", "tier"},
		"Retries held by the Delayer (publish confirmed), by queue and delay tier."},
	{nameRetryDelay, "histogram", []string{"queue"},
		"Delay requested for each scheduled retry, in seconds."},
	{nameRepublish, "histogram", []string{"queue"},
		"Time the Delayer took to hold a retry copy (publish and confirm), in seconds."},
	{nameRetryFailures, "counter", []string{"queue"},
		"Retries the Delayer could not hold; the message was nacked."},
	{namePoisoned, "counter", []string{"queue", "class"},
		"Messages confirmed into the poison queue, by queue and error class."},
	{namePoisonFailures, "counter", []string{"queue"},
		"Poison-queue publishes that failed; the message was nacked."},
	{nameDropped, "counter", []string{"queue"},
		"Messages acked and discarded on a drop verdict."},
	{namePaused, "gauge", nil,
		"1 while consumption is paused because a dependency is down (middleware.Pause), else 0."},
	{namePauses, "counter", []string{"reason"},
		`Times consumption paused, by reason ("dependency-unavailable" or "failure-rate").`},
	{namePausedSeconds, "counter", nil,
		"Seconds consumption spent paused, added when it resumes."},
	{nameRouteInPlace, "gauge", []string{"queue", "route"},
		"1 when the last check found the broker-side retry route (dead-letter-first, native-delayed-retry) in place, 0 when retries take the publish path."},
	{nameRouteProblems, "counter", []string{"queue", "route"},
		"Checks that found the broker-side retry route not in place (policy drift, missing or length-limited first wait queue)."},
}

// descriptions returns the metrics New registers, with full names for
// namespace ("" means defaultNamespace), types, labels and help texts.
func descriptions(namespace string) []description {
	if namespace == "" {
		namespace = defaultNamespace
	}
	out := make([]description, len(specs))
	for i, s := range specs {
		out[i] = description{
			Name:   prometheus.BuildFQName(namespace, "", s.name),
			Type:   s.typ,
			Labels: append([]string(nil), s.labels...),
			Help:   s.help,
		}
	}
	return out
}

func specFor(name string) spec {
	for _, s := range specs {
		if s.name == name {
			return s
		}
	}
	panic("metrics: no spec for " + name)
}

// New creates the collectors and registers them with cfg.Registerer. It
// returns the error of cfg.Validate, or the first registration error wrapped
// with the metric's name (errors.As finds a prometheus.AlreadyRegisteredError
// when the same metrics are registered twice with one Registerer); the
// collectors registered before the failure are then unregistered again.
func New(cfg Config) (*Metrics, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	ns := cfg.Namespace
	counter := func(name string) *prometheus.CounterVec {
		s := specFor(name)
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: s.name, Help: s.help}, s.labels)
	}
	histogram := func(name string, buckets []float64) *prometheus.HistogramVec {
		s := specFor(name)
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: s.name, Help: s.help, Buckets: append([]float64(nil), buckets...),
		}, s.labels)
	}
	gauge := func(name string) *prometheus.GaugeVec {
		s := specFor(name)
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: s.name, Help: s.help}, s.labels)
	}
	m := &Metrics{
		queueName:        cfg.QueueName,
		tier:             cfg.Tier,
		attempts:         counter(nameAttempts),
		attemptNumber:    histogram(nameAttemptNumber, attemptNumberBuckets()),
		retriesScheduled: counter(nameRetriesScheduled),
		retryDelay:       histogram(nameRetryDelay, cfg.DelayBuckets),
		republish:        histogram(nameRepublish, cfg.LatencyBuckets),
		retryFailures:    counter(nameRetryFailures),
		poisoned:         counter(namePoisoned),
		poisonFailures:   counter(namePoisonFailures),
		dropped:          counter(nameDropped),
		paused:           gauge(namePaused),
		pauses:           counter(namePauses),
		pausedSeconds:    counter(namePausedSeconds),
		routeInPlace:     gauge(nameRouteInPlace),
		routeProblems:    counter(nameRouteProblems),
	}
	collectors := []struct {
		name string
		c    prometheus.Collector
	}{
		{nameAttempts, m.attempts},
		{nameAttemptNumber, m.attemptNumber},
		{nameRetriesScheduled, m.retriesScheduled},
		{nameRetryDelay, m.retryDelay},
		{nameRepublish, m.republish},
		{nameRetryFailures, m.retryFailures},
		{namePoisoned, m.poisoned},
		{namePoisonFailures, m.poisonFailures},
		{nameDropped, m.dropped},
		{namePaused, m.paused},
		{namePauses, m.pauses},
		{namePausedSeconds, m.pausedSeconds},
		{nameRouteInPlace, m.routeInPlace},
		{nameRouteProblems, m.routeProblems},
	}
	for i, c := range collectors {
		if err := cfg.Registerer.Register(c.c); err != nil {
			for _, done := range collectors[:i] {
				cfg.Registerer.Unregister(done.c)
			}
			msg := "registering"
			if are := (prometheus.AlreadyRegisteredError{}); errors.As(err, &are) {
				msg = "already registered (one metrics.New per Registerer and Namespace):"
			}
			return nil, fmt.Errorf("metrics.New: %s %s: %w", msg, prometheus.BuildFQName(ns, "", c.name), err)
		}
	}
	return m, nil
}

// Middleware counts each handler attempt in attempts_total (outcome
// "success" when h returns a nil error, else "error"; a panic counts as
// "error" and is passed on) and observes its attempt number
// (middleware.Attempt) in attempt_number. Add it after the retry chain's
// middleware, so that it runs inside the chain:
// r.AddMiddleware(chain.Middleware, m.Middleware).
func (m *Metrics) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		queue := m.queue(msg)
		attempt := middleware.Attempt(msg)
		returned := false
		defer func() {
			outcome := outcomeSuccess
			if err != nil || !returned {
				outcome = outcomeError
			}
			m.attempts.WithLabelValues(queue, outcome).Inc()
			m.attemptNumber.WithLabelValues(queue).Observe(float64(attempt))
		}()
		out, err = h(msg)
		returned = true
		return out, err
	}
}

// Observer returns the middleware.Observer that records what the retry
// chain did with each failed message: scheduled and failed retries, poisoned
// messages, failed poison publishes and drops. It also implements
// middleware.PauseObserver (paused, pauses_total, paused_seconds_total) and
// middleware.RouteObserver (broker_route_in_place,
// broker_route_problems_total), which router.Policy (for Policy.Pause) and
// amqpretry's broker-side retry routes pick up. Pass it as
// router.Policy.Observer; every call returns an observer of the same
// collectors.
func (m *Metrics) Observer() middleware.Observer { return observer{m} }

// RetryScheduled (middleware.Observer): it counts the retry in
// retries_scheduled_total under its delay tier, and observes delay in
// retry_delay_seconds and took in republish_seconds.
func (o observer) RetryScheduled(msg *message.Message, attempt int, delay, took time.Duration) {
	q := o.m.queue(msg)
	o.m.retriesScheduled.WithLabelValues(q, retrymeta.FormatDelay(o.m.tier(delay))).Inc()
	o.m.retryDelay.WithLabelValues(q).Observe(delay.Seconds())
	o.m.republish.WithLabelValues(q).Observe(took.Seconds())
}

// RetryFailed (middleware.Observer): it counts
// retry_failures_total.
func (o observer) RetryFailed(msg *message.Message, attempt int, err error) {
	o.m.retryFailures.WithLabelValues(o.m.queue(msg)).Inc()
}

// Poisoned (middleware.Observer): it counts poisoned_total under
// class ("unknown" when empty).
func (o observer) Poisoned(msg *message.Message, attempt int, class string) {
	if class == "" {
		class = "unknown"
	}
	o.m.poisoned.WithLabelValues(o.m.queue(msg), class).Inc()
}

// PoisonFailed (middleware.Observer): it counts
// poison_failures_total.
func (o observer) PoisonFailed(msg *message.Message, attempt int, err error) {
	o.m.poisonFailures.WithLabelValues(o.m.queue(msg)).Inc()
}

// Dropped (middleware.Observer): it counts dropped_total.
func (o observer) Dropped(msg *message.Message, attempt int) {
	o.m.dropped.WithLabelValues(o.m.queue(msg)).Inc()
}

// PauseStarted (middleware.PauseObserver): paused = 1 and
// pauses_total{reason} + 1.
func (o observer) PauseStarted(reason string) {
	o.m.paused.WithLabelValues().Set(1)
	o.m.pauses.WithLabelValues(reason).Inc()
}

// PauseEnded (middleware.PauseObserver): paused = 0 and d added to
// paused_seconds_total.
func (o observer) PauseEnded(d time.Duration) {
	o.m.paused.WithLabelValues().Set(0)
	o.m.pausedSeconds.WithLabelValues().Add(d.Seconds())
}

// RouteChecked (middleware.RouteObserver): it sets
// broker_route_in_place to 1 (problem "") or 0, and counts
// broker_route_problems_total when problem is not "".
func (o observer) RouteChecked(queue, route, problem string) {
	if queue == "" {
		queue = unknownQueue
	}
	if problem == "" {
		o.m.routeInPlace.WithLabelValues(queue, route).Set(1)
		return
	}
	o.m.routeInPlace.WithLabelValues(queue, route).Set(0)
	o.m.routeProblems.WithLabelValues(queue, route).Inc()
}

// queue returns the queue label of msg.
func (m *Metrics) queue(msg *message.Message) string {
	if q := m.queueName(msg.Context()); q != "" {
		return q
	}
	if q := msg.Metadata.Get(middleware.OriginalQueueKey); q != "" {
		return q
	}
	return unknownQueue
}
