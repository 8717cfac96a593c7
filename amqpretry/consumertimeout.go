package amqpretry

import (
	"context"
	"fmt"
	"maps"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/mgmt"
)

// defaultBrokerConsumerTimeout is RabbitMQ's default consumer_timeout
// (rabbitmq.conf), 30 minutes: how long a consumer may hold an unacked
// delivery before the broker takes it back ("Delivery Acknowledgement
// Timeout").
const defaultBrokerConsumerTimeout = 30 * time.Minute

// HandlerDeadline configures the deadline the retry chain puts on each
// handler's context (Config.HandlerDeadline), derived from the originating
// queue's effective consumer timeout, so that a handler that runs too long
// ends as a counted retry before the broker takes its delivery back.
//
// Why: when a delivery stays unacked longer than the consumer timeout,
// RabbitMQ returns it to the queue (4.3+ quorum queues: basic.cancel of the
// consumer; earlier versions: the channel is closed). The handler's result
// can then no longer be settled on that delivery, and the message runs
// again without its attempt being counted. With the deadline, a handler
// that honours its context (msg.Context()) returns context.DeadlineExceeded
// in time; the chain classifies it as any other error (a transient failure
// unless a Classifier rule says otherwise), publishes the retry copy, waits
// for its confirm, and acks the original while the delivery is still
// valid. A handler that ignores its context and still finishes after the
// consumer timeout is covered as before: its result is remembered and
// settled on the redelivery without running it again (see
// Retry.Middleware).
//
// The effective consumer timeout of queue Q (RabbitMQ "Consumers",
// "Delivery Acknowledgement Timeout"; rabbitmq-server consumer_timeouts.md):
//  1. x-consumer-timeout in Config.Subscriber.Consume.Arguments (the
//     consumer's own, RabbitMQ 3.12+), if set;
//  2. otherwise the smaller of Q's x-consumer-timeout argument (from
//     Config.Subscriber.Queue.Arguments, or, with a management API, the
//     queue's actual arguments) and the consumer-timeout key of the policy
//     that applies to Q (read through the management API: the queue's
//     effective_policy_definition; RabbitMQ 3.12+);
//  3. otherwise the broker's consumer_timeout, which no API reports:
//     BrokerConsumerTimeout.
//
// On RabbitMQ 4.3+ consumer timeouts apply to quorum queues only: a classic
// queue gets no deadline (and New logs that no consumer timeout protects
// it). On older brokers, they apply to every queue type.
//
// The deadline counts from the moment the delivery reaches the chain
// (Retry.Middleware). With a prefetch above 1, a delivery may have waited
// in the client's prefetch buffer behind slower ones before that, and the
// broker's clock started when it was sent: it then has less time than the
// deadline says (the late result is still settled on the redelivery).
// Prefetch 1 makes the deadline exact for long handlers.
//
// Each originating queue's deadline is worked out when its topology is
// declared (a subscription starts) and logged; with a management API it is
// read again at most every minute. A warning is logged at Error level when
// HandlerTimeout exceeds the deadline, and at Info level when the consumer
// timeout cannot be determined (BrokerConsumerTimeout not set and nothing
// more specific applies: RabbitMQ's 30-minute default is assumed).
type HandlerDeadline struct {
	// Disabled turns the deadline off: handlers get the subscriber's
	// context unchanged. Default false.
	Disabled bool
	// BrokerConsumerTimeout is the broker's own consumer_timeout
	// (rabbitmq.conf), used when neither the consumer, the queue's arguments
	// nor a policy sets one. Zero: RabbitMQ's default, 30 min, is
	// assumed and a warning says it could not be determined; negative: the
	// broker has none (consumer_timeout disabled), so no deadline applies
	// unless the queue or consumer sets one.
	BrokerConsumerTimeout time.Duration
	// Margin is taken off the effective consumer timeout: the time left
	// for the retry copy's publish and confirm and the ack once the
	// handler's context has expired. Default: a tenth of the consumer
	// timeout, at least 1 s and at most 1 min; the deadline is never below
	// half the consumer timeout. Negative is an error.
	Margin time.Duration
	// HandlerTimeout is how long the application lets a handler run, if it
	// bounds it itself (e.g. watermill's middleware.Timeout); used only
	// for a warning when it exceeds the deadline (the broker would take
	// the delivery back before it). Zero: not checked. Negative is an
	// error.
	HandlerTimeout time.Duration
}

// validate reports the first bad field (Config.Validate calls it).
func (h HandlerDeadline) validate() error {
	if h.Margin < 0 {
		return fmt.Errorf("amqpretry.Config.HandlerDeadline.Margin %v is negative", h.Margin)
	}
	if h.HandlerTimeout < 0 {
		return fmt.Errorf("amqpretry.Config.HandlerDeadline.HandlerTimeout %v is negative", h.HandlerTimeout)
	}
	return nil
}

// deadlineRefresh is how long a queue's deadline read through the
// management API is reused: a policy change is seen within this time.
const deadlineRefresh = time.Minute

// deadlineLookupTimeout bounds one management API lookup.
const deadlineLookupTimeout = 3 * time.Second

// consumerTimeout is a queue's effective consumer timeout and where it
// comes from.
type consumerTimeout struct {
	timeout time.Duration // 0: none applies
	source  string        // e.g. "x-consumer-timeout consumer argument"
	assumed bool          // the broker default was assumed, not known
}

// timeoutInputs are what the effective consumer timeout depends on.
type timeoutInputs struct {
	version       string // broker version; "" unknown
	queueType     string // the queue's type
	consumerArg   any    // x-consumer-timeout on basic.consume, nil if unset
	queueArg      any    // x-consumer-timeout queue argument, nil if unset
	policy        any    // consumer-timeout of the applying policy, nil if unset
	brokerDefault time.Duration
}

// effectiveTimeout applies RabbitMQ's precedence (see HandlerDeadline).
func effectiveTimeout(in timeoutInputs) consumerTimeout {
	major, minor, known := parseMajorMinor(in.version)
	if known && (major > 4 || (major == 4 && minor >= 3)) && in.queueType != QueueTypeQuorum {
		return consumerTimeout{source: "RabbitMQ " + in.version + " applies no consumer timeout to " + in.queueType + " queues"}
	}
	// Per-queue and per-consumer timeouts came with 3.11.15 / 3.12; an
	// older broker ignores them (an unknown version is taken as recent).
	perQueue := !known || major > 3 || (major == 3 && minor >= 12)
	broker := consumerTimeout{timeout: in.brokerDefault, source: "the broker's consumer_timeout (HandlerDeadline.BrokerConsumerTimeout)"}
	if in.brokerDefault == 0 {
		broker = consumerTimeout{timeout: defaultBrokerConsumerTimeout, source: "RabbitMQ's default consumer_timeout (assumed)", assumed: true}
	} else if in.brokerDefault < 0 {
		broker = consumerTimeout{source: "none (HandlerDeadline.BrokerConsumerTimeout negative)"}
	}
	if !perQueue {
		return broker
	}
	if d, ok := timeoutMillis(in.consumerArg); ok {
		return consumerTimeout{timeout: d, source: "x-consumer-timeout consumer argument"}
	}
	q, qok := timeoutMillis(in.queueArg)
	p, pok := timeoutMillis(in.policy)
	switch {
	case qok && pok && p < q:
		return consumerTimeout{timeout: p, source: "consumer-timeout policy key (below the queue argument)"}
	case qok:
		return consumerTimeout{timeout: q, source: "x-consumer-timeout queue argument"}
	case pok:
		return consumerTimeout{timeout: p, source: "consumer-timeout policy key"}
	}
	return broker
}

// timeoutMillis reads a positive millisecond count as AMQP tables, JSON or
// a policy carry it.
func timeoutMillis(v any) (time.Duration, bool) {
	var ms float64
	switch n := v.(type) {
	case nil:
		return 0, false
	case int:
		ms = float64(n)
	case int8:
		ms = float64(n)
	case int16:
		ms = float64(n)
	case int32:
		ms = float64(n)
	case int64:
		ms = float64(n)
	case uint8:
		ms = float64(n)
	case uint16:
		ms = float64(n)
	case uint32:
		ms = float64(n)
	case uint64:
		ms = float64(n)
	case float32:
		ms = float64(n)
	case float64:
		ms = n
	case string:
		f, err := strconv.ParseFloat(n, 64)
		if err != nil {
			return 0, false
		}
		ms = f
	default:
		return 0, false
	}
	if ms <= 0 || math.IsNaN(ms) || ms > float64(math.MaxInt64/int64(time.Millisecond)) {
		return 0, false
	}
	return time.Duration(ms) * time.Millisecond, true
}

// deadlineFor is the handler deadline for consumer timeout t with margin
// (0: the default).
func deadlineFor(t, margin time.Duration) time.Duration {
	if margin == 0 {
		margin = min(max(t/10, time.Second), time.Minute)
	}
	return max(t-margin, t/2)
}

// deadlines works out and caches each originating queue's handler
// deadline, and applies it to handlers.
type deadlines struct {
	cfg       HandlerDeadline
	version   string
	queueType string
	consumer  any // Subscriber.Consume.Arguments x-consumer-timeout
	queueArg  any // Subscriber.Queue.Arguments x-consumer-timeout
	mgmt      *mgmtClient
	vhost     string
	logger    watermill.LoggerAdapter

	mu      sync.Mutex
	entries map[string]*deadlineEntry
}

type deadlineEntry struct {
	deadline time.Duration // 0: none
	at       time.Time
	loading  bool
}

// newDeadlines returns nil when the deadline is disabled.
func newDeadlines(cfg Config, version string) (*deadlines, error) {
	if cfg.HandlerDeadline.Disabled {
		return nil, nil
	}
	d := &deadlines{
		cfg: cfg.HandlerDeadline, version: version, queueType: cfg.QueueType,
		consumer: cfg.Subscriber.Consume.Arguments["x-consumer-timeout"],
		queueArg: cfg.Subscriber.Queue.Arguments["x-consumer-timeout"],
		logger:   cfg.Logger, entries: map[string]*deadlineEntry{},
	}
	murl := cfg.ManagementURL
	mc := AdoptQueue{ManagementURL: murl}
	if a := cfg.AdoptQueue; a != nil {
		mc.HTTPClient = a.HTTPClient
		if mc.ManagementURL == "" {
			mc.ManagementURL = a.ManagementURL
		}
	}
	if mc.ManagementURL != "" {
		u, err := amqp.ParseURI(cfg.URI)
		if err != nil {
			return nil, fmt.Errorf("amqpretry: %w", err)
		}
		d.vhost = u.Vhost
		if d.mgmt, err = newMgmtClient(&mc, "ManagementURL"); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// resolve works out q's deadline now (management API lookup included),
// caches it and logs it, with the warnings HandlerDeadline describes.
func (d *deadlines) resolve(q string) time.Duration {
	in := timeoutInputs{version: d.version, queueType: d.queueType, consumerArg: d.consumer,
		queueArg: d.queueArg, brokerDefault: d.cfg.BrokerConsumerTimeout}
	var lookupErr error
	if d.mgmt != nil {
		ctx, cancel := context.WithTimeout(context.Background(), deadlineLookupTimeout)
		mq, err := d.mgmtQueue(ctx, q)
		cancel()
		switch {
		case err != nil:
			lookupErr = err
		case mq != nil:
			if t, _ := mq["type"].(string); t != "" {
				in.queueType = t
			}
			if args, _ := mq["arguments"].(map[string]any); args != nil {
				if v, ok := args["x-consumer-timeout"]; ok {
					in.queueArg = v
				}
			}
			if def, _ := mq["effective_policy_definition"].(map[string]any); def != nil {
				in.policy = def["consumer-timeout"]
			}
		}
	}
	ct := effectiveTimeout(in)
	var deadline time.Duration
	if ct.timeout > 0 {
		deadline = deadlineFor(ct.timeout, d.cfg.Margin)
	}

	d.mu.Lock()
	e := d.entries[q]
	first := e == nil
	changed := first || e.deadline != deadline
	if first {
		e = &deadlineEntry{}
		d.entries[q] = e
	}
	e.deadline, e.at, e.loading = deadline, time.Now(), false
	d.mu.Unlock()

	fields := watermill.LogFields{"queue": q, "consumer_timeout": ct.timeout.String(), "source": ct.source,
		"handler_deadline": deadline.String(), "broker_version": d.version, "queue_type": in.queueType}
	if lookupErr != nil {
		fields["management_error"] = lookupErr.Error()
	}
	if !changed {
		return deadline
	}
	d.logger.Info("Handler deadline derived from the queue's consumer timeout", fields)
	if ct.assumed && first {
		// Info, not Error: the normal case of a broker left at its default.
		warn := maps.Clone(fields)
		warn["hint"] = "no x-consumer-timeout consumer or queue argument nor consumer-timeout policy applies (or no management API to read policies), and no API reports the broker's consumer_timeout: set Config.HandlerDeadline.BrokerConsumerTimeout to the broker's value"
		d.logger.Info("Warning: the queue's consumer timeout cannot be determined; assuming RabbitMQ's default 30 min", warn)
	}
	if h := d.cfg.HandlerTimeout; h > 0 && deadline > 0 && h > deadline {
		fields = maps.Clone(fields)
		fields["handler_timeout"] = h.String()
		d.logger.Error("Configured handler timeout exceeds the queue's handler deadline", fmt.Errorf(
			"HandlerDeadline.HandlerTimeout %v is longer than the deadline %v (consumer timeout %v from %s, minus the margin): handlers are cut short at the deadline and retried; raise the consumer timeout or shorten the handler timeout",
			h, deadline, ct.timeout, ct.source), fields)
	}
	return deadline
}

// mgmtQueue reads queue q through the management API: the queue record
// (?disable_stats=true), which on RabbitMQ 4.x shows the policy that
// applies at once, or, where that record has no
// effective_policy_definition (3.x), the statistics view, which shows it
// within the statistics interval. nil, nil: no such queue.
func (d *deadlines) mgmtQueue(ctx context.Context, q string) (map[string]any, error) {
	path := mgmt.Path("queues", d.vhost, q)
	var mq map[string]any
	for _, p := range []string{path + "?disable_stats=true", path} {
		mq = nil
		if err := d.mgmt.Do(ctx, http.MethodGet, p, nil, &mq); err != nil {
			if mgmt.IsNotFound(err) {
				return nil, nil
			}
			return nil, err
		}
		if _, ok := mq["effective_policy_definition"]; ok {
			break
		}
	}
	return mq, nil
}

// forQueue returns q's deadline, 0 for none: the cached one, refreshed in
// the background when read through the management API more than
// deadlineRefresh ago; resolved now if q was never seen.
func (d *deadlines) forQueue(q string) time.Duration {
	d.mu.Lock()
	e := d.entries[q]
	if e == nil {
		d.mu.Unlock()
		return d.resolve(q)
	}
	deadline := e.deadline
	if d.mgmt != nil && !e.loading && time.Since(e.at) > deadlineRefresh {
		e.loading = true
		go d.resolve(q)
	}
	d.mu.Unlock()
	return deadline
}

// chainStartKey holds, in a message's context, when it reached the chain.
type chainStartKey struct{}

// markStart records in msg's context that it reached the chain now: in
// its run's state when in Retry.Middleware (no allocation), else in a
// context value.
func markStart(msg *message.Message) {
	if st := runOf(msg); st != nil {
		st.start = time.Now()
		return
	}
	msg.SetContext(context.WithValue(msg.Context(), chainStartKey{}, time.Now()))
}

// prepare marks the run's start (markStart) and works out its handler
// deadline for wrap, from q's.
func (d *deadlines) prepare(st *runState, q string) {
	st.start = time.Now()
	st.prepared = true
	st.deadline = d.forQueue(q)
	if st.deadline > 0 {
		// In the run state's own allocation: one allocation per message
		// for both.
		st.dlCtx.deadline, st.dlCtx.timeout = st.start.Add(st.deadline), st.deadline
		st.dl = &st.dlCtx
	}
}

// chainStart returns when the message whose context is ctx reached the
// chain (markStart), or now if unknown.
func chainStart(ctx context.Context) time.Time {
	if st, _ := ctx.Value(runStateKey{}).(*runState); st != nil && !st.start.IsZero() {
		return st.start
	}
	if start, ok := ctx.Value(chainStartKey{}).(time.Time); ok {
		return start
	}
	return time.Now()
}

// wrap gives h's message a context with q's deadline, counted from when
// the message reached the chain, restoring the chain's context afterwards
// (the chain's own work after the handler is bounded by its own
// timeouts, not by this deadline).
func (d *deadlines) wrap(queueName func(context.Context) string, h message.HandlerFunc) message.HandlerFunc {
	if d == nil {
		return h
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		orig := msg.Context()
		deadline := d.forQueue(queueName(orig))
		if deadline <= 0 {
			return h(msg)
		}
		return d.run(newLazyDeadline(chainStart(orig).Add(deadline)), deadline, queueName, msg, h)
	}
}

// enter puts the deadline prepare worked out for st's run (st.dl; nil
// when no deadline applies) on msg's context (wrap's work, done from
// recordVerdict to spare the handler goroutine's deepest frames another
// context lookup and frame). Then the handler runs, then
// verdictRecorder.leave.
func (d *deadlines) enter(st *runState, msg *message.Message) {
	st.prepared = false
	if st.dl == nil {
		return
	}
	st.dl.Context = msg.Context()
	msg.SetContext(st.dl)
}

// run runs h with ctx (deadline's context, its parent not yet set) as its
// message's context.
func (d *deadlines) run(ctx *lazyDeadlineCtx, deadline time.Duration, queueName func(context.Context) string, msg *message.Message, h message.HandlerFunc) ([]*message.Message, error) {
	orig := msg.Context()
	// Lazy: no timer unless the handler looks at its context.
	ctx.Context = orig
	defer ctx.stop()
	msg.SetContext(ctx)
	out, err := h(msg)
	if msg.Context() == ctx {
		msg.SetContext(orig)
	}
	if err != nil {
		d.failed(ctx, deadline, queueName, msg)
	}
	return out, err
}

// failed logs a handler failure that its deadline explains. Out of line:
// run's frame stays small.
//
//go:noinline
func (d *deadlines) failed(ctx *lazyDeadlineCtx, deadline time.Duration, queueName func(context.Context) string, msg *message.Message) {
	orig := ctx.Context
	if ctx.Err() == context.DeadlineExceeded && orig.Err() == nil {
		d.logger.Info("Handler overran its deadline, set below the queue's consumer timeout; its failure is retried while the delivery is still valid", watermill.LogFields{
			"queue": queueName(orig), "message_uuid": msg.UUID, "handler_deadline": deadline.String(), "ran": time.Since(chainStart(orig)).String()})
	}
}
