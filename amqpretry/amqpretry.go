// Package amqpretry is the RabbitMQ side of the retry library: the retry
// topology (loop-back exchange, one wait queue per delay tier, poison queue),
// a Marshaler that reads x-death and x-delivery-count instead of failing,
// republishing with publisher confirms and mandatory returns, and New, which
// wires it all into one Watermill middleware.
//
//	retry, err := amqpretry.New(amqpretry.Config{URI: uri, Subscriber: subCfg})
//	sub, err := retry.NewSubscriber(logger, 0)
//	router.AddMiddleware(retry.Middleware)
package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// MaxTiers bounds the number of delay tiers (one wait queue each, per
// originating queue).
const MaxTiers = 32

// Config configures New. Zero values take the defaults given.
type Config struct {
	// URI is the AMQP URI the retry publisher connects to, e.g.
	// "amqp://guest:guest@localhost:5672/". Default: Subscriber.Connection.AmqpURI.
	// The publisher dials it with the subscriber's connection settings, as
	// watermill-amqp does (Subscriber.Connection.AmqpConfig, else
	// Subscriber.Connection.TLSConfig: TLS, heartbeat, Dial and so the dial
	// timeout, vhost, SASL, client properties; see PublisherConfig.AmqpConfig),
	// under its own connection_name (the subscriber's connection_name +
	// ".retry-publisher", else DefaultPublisherConnectionName). Setting
	// both TLSConfig and AmqpConfig.TLSClientConfig is an error.
	URI string
	// Subscriber is the watermill-amqp config of the subscriber(s) whose
	// handlers get retries, e.g. wamqp.NewDurableQueueConfig(uri). Its
	// Queue.GenerateName maps a subscribe topic to the originating queue.
	// SubscriberConfig returns it with the retry topology, Marshaler and
	// NoRequeueOnNack set. Its Queue.Arguments must not set
	// x-dead-letter-exchange or x-dead-letter-routing-key (amqpretry does).
	Subscriber wamqp.Config
	// QueueType of the originating queue, wait and poison queues: "classic"
	// (default) or "quorum". Default: "quorum" when Subscriber.Queue.Arguments
	// has x-queue-type quorum. With quorum, dead-lettering is at-least-once
	// (x-dead-letter-strategy at-least-once with x-overflow reject-publish;
	// RabbitMQ 3.10+, "Quorum Queues"). amqpretry sets no x-delivery-limit: on
	// RabbitMQ 4.0+ (default limit 20) a message over the limit is
	// dead-lettered into the wait path, not dropped, because Q has a DLX, and
	// its delivery_limit deaths count as attempts.
	QueueType string
	// MaxAttempts is the total number of attempts, the first included.
	// Default 5; range [1, 1000].
	MaxAttempts int
	// Backoff makes a fresh backoff policy for each delay computation.
	// Default middleware.DefaultBackoff (1 s, x2, ±50% jitter, 5 min cap).
	Backoff func() backoff.BackOff
	// Tiers are the wait-queue delays (time.Duration, each in [1 ms, MaxTTL],
	// at most MaxTiers). A computed delay goes to the smallest tier >= it
	// (see Topology.TierFor). Default: the delays of attempts 1..MaxAttempts-1
	// under Backoff without jitter (for an *backoff.ExponentialBackOff policy;
	// otherwise one sample each), rounded to milliseconds and deduplicated.
	// Not used with DelayerFactory (no wait queue is declared; setting Tiers
	// then is an error).
	Tiers []time.Duration
	// Naming of exchanges and queues. Defaults in Naming.
	Naming Naming
	// QueueName maps a message's context to its originating queue. Default:
	// Subscriber.Queue.GenerateName(message.SubscribeTopicFromCtx(ctx)).
	QueueName func(ctx context.Context) string
	// Classifier configures error classification (router.Config.Classifier).
	Classifier middleware.ClassifierConfig
	// ErrorText renders errors into headers; redact secrets here. Default:
	// err.Error() cut to 1 KiB.
	ErrorText func(error) string
	// Pause, when set, pauses consumption while a dependency is down instead
	// of charging attempts: see router.Config.Pause and middleware.Pause.
	// Default nil (off).
	Pause *middleware.PauseConfig
	// CrashQuarantine makes Retry.NewSubscriber also consume each queue's
	// quarantine queue (Naming.QuarantineQueue) with prefetch 1, so that a
	// crash is counted against the message that crashed, not against the
	// neighbours the consumer held: the RedeliveryGuard moves a redelivered
	// message there, where it runs alone. Known limit, why it is opt-in: a
	// graceful stop that returns a quarantined message it had not started
	// counts as one of its redeliveries, so deploys in quick succession can
	// poison a quarantined message that never crashed. Default false: every
	// redelivery counts in the originating queue (with prefetch N, a crash
	// counts against up to N messages; use prefetch 1 where crashes are
	// likely).
	CrashQuarantine bool
	// Tracing, when set, traces every attempt with OpenTelemetry: see
	// router.Config.Tracing and middleware.Tracing. Default nil (off).
	Tracing *middleware.TracingConfig
	// Observer is told of retries and poisonings (metrics).
	Observer middleware.Observer
	// DeadLetterFirstRetry makes retries that fall in the first tier go to
	// the first wait queue by dead-lettering the original (a nack;
	// Q's x-dead-letter-routing-key already points there) instead of a
	// published copy: no publish-confirm round trip is waited for in the
	// handler, so a burst of failures drains much faster. The attempt is
	// counted from x-death; that hop records no failure metadata
	// (rabbitretry-first-failure is then the first failure that took the
	// publish path). Requires QueueType "quorum", whose dead-lettering is
	// at-least-once; a classic queue's is at-most-once. Default false.
	//
	// The nack gets no confirm, so before relying on it the Delayer checks
	// that the route is in place, at most every 2 s per queue: the first
	// wait queue exists (passive declare), and, with a management API
	// (ManagementURL), no policy or operator policy gives it a length limit
	// (a full reject-publish target holds dead-letters unseen in Q's
	// dead-letter buffer) and, for an adopted Q, the library's policy is
	// the one that applies ("Policies", "Dead Letter Exchanges"). While a
	// check fails, first retries take the publish path (confirmed copy,
	// fallback behind it); the change is logged (Error, then Info when the
	// route is back) and reported to an Observer that implements
	// middleware.RouteObserver (metrics.Metrics does).
	DeadLetterFirstRetry bool
	// NativeDelayedRetry, when set, hands short retries to the queue's own
	// delayed retry (RabbitMQ 4.3+ quorum queues; see NativeDelayedRetry):
	// the original is nacked with requeue and the queue holds it for Min,
	// with no copy and no publish round trip; longer retries still take the
	// wait queues. Q is declared with the x-delayed-retry-* arguments (an
	// existing Q declared without them gets a *DeclareError: add them by
	// policy, or declare a new queue). Attempts are counted from the
	// broker's x-acquired-count (middleware.AcquiredCountSource), so a
	// consumer crash uses an attempt and MaxRedeliveries is not used. The
	// native hop records no failure metadata. Requires QueueType quorum and
	// RabbitMQ 4.3+ (New refuses it otherwise); excludes
	// DeadLetterFirstRetry. Default nil (off).
	NativeDelayedRetry *NativeDelayedRetry
	// DelayerFactory, when set, replaces the wait queues by another delay
	// mechanism for every retry with a positive delay, e.g. the delay
	// cascade (cascade.DelayerFactory), which delivers after the exact
	// delay (to its grain) instead of rounding it to a tier. New calls it
	// once, after connecting the retry publisher (see DelayerFactory,
	// CustomDelayer). Copies with no delay (the fallback's and the
	// RedeliveryGuard's) still go back to their queue through the loop-back
	// exchange. No wait queue is declared, Tiers must be empty (Topology
	// has no tiers: TierFor returns 0), and DeadLetterFirstRetry and
	// NativeDelayedRetry, which hand retries to the broker without the
	// Delayer, are refused by Validate. Wait queues declared by an earlier
	// deploy with tiers are left alone (Topology.Inspect reports them as
	// orphans; TidyOrphans deletes them once empty). Default nil (tiers).
	DelayerFactory DelayerFactory
	// ManagementURL is the RabbitMQ management HTTP API's base URL with
	// credentials, e.g. "http://guest:guest@127.0.0.1:15672", used to check
	// the broker-side routes of DeadLetterFirstRetry and NativeDelayedRetry
	// against the current policies and operator policies (GET
	// /api/policies/{vhost}, /api/operator-policies/{vhost}; see
	// DeadLetterFirstRetry). Empty: AdoptQueue.ManagementURL, if any; with
	// neither, only what AMQP shows is checked (the first wait queue
	// exists), so a length limit an operator puts on it goes unseen.
	// Never logged with its password.
	ManagementURL string
	// AdoptQueue, when set, adopts existing originating queues: their queue
	// arguments are left alone (passive declare) and what the retry mode
	// needs from them is set by a policy, applied through the management
	// API or logged as a rabbitmqctl command (see AdoptQueue). Default nil:
	// the library declares Q with the arguments it needs.
	AdoptQueue *AdoptQueue
	// MaxRedeliveries bounds the crashes a message may cause (runs ended by
	// a broker redelivery: consumer crash, connection loss, consumer
	// timeout, a requeue): the redelivery that brings its count to
	// MaxRedeliveries (with CrashQuarantine: in the quarantine queue, where
	// it is attributable), poisons it with
	// class "redelivery-limit" without running the handler again (see
	// middleware.RedeliveryGuard). Default 3; range [1, 1000].
	MaxRedeliveries int
	// FallbackPause is how long a message whose retry or poison copy the
	// broker did not confirm waits before the fallback copy back to its queue
	// (or, if that fails too, the requeue). Default 1 s; negative: none. A
	// retry whose handler asked for a longer RetryAfter waits that long
	// instead (router.Config.FallbackPause): never earlier than asked.
	FallbackPause time.Duration
	// PublisherChannels is the number of AMQP channels used for republishing.
	// Default 2.
	PublisherChannels int
	// ConfirmTimeout bounds the wait for a publisher confirm, and every
	// socket write of the retry publisher (PublisherConfig.ConfirmTimeout).
	// While the broker blocks publishers (a memory or disk alarm, RabbitMQ
	// "Blocked Connection Notifications") retry and poison publishes fail at
	// once with ErrBlocked instead. Default 30 s.
	ConfirmTimeout time.Duration
	// Logger receives structured logs. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.URI == "" {
		c.URI = c.Subscriber.Connection.AmqpURI
	}
	if c.QueueType == "" {
		c.QueueType = QueueTypeClassic
		if qt, _ := c.Subscriber.Queue.Arguments["x-queue-type"].(string); qt == QueueTypeQuorum {
			c.QueueType = QueueTypeQuorum
		}
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	if c.Backoff == nil {
		c.Backoff = middleware.DefaultBackoff
	}
	if len(c.Tiers) == 0 && c.DelayerFactory == nil && c.MaxAttempts >= 1 && c.MaxAttempts <= middleware.MaxAttemptsCap {
		c.Tiers = DefaultTiers(c.Backoff, c.MaxAttempts)
	}
	c.Naming.setDefaults()
	if c.QueueName == nil && c.Subscriber.Queue.GenerateName != nil {
		gen := c.Subscriber.Queue.GenerateName
		c.QueueName = func(ctx context.Context) string { return gen(message.SubscribeTopicFromCtx(ctx)) }
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field by name.
func (c Config) Validate() error {
	if c.URI == "" {
		return errors.New("amqpretry.Config.URI is empty (and Subscriber.Connection.AmqpURI too)")
	}
	if c.Subscriber.Queue.GenerateName == nil {
		return errors.New("amqpretry.Config.Subscriber.Queue.GenerateName is nil (use a watermill-amqp New*Config)")
	}
	for _, k := range []string{"x-dead-letter-exchange", "x-dead-letter-routing-key"} {
		if _, ok := c.Subscriber.Queue.Arguments[k]; ok {
			return fmt.Errorf("amqpretry.Config.Subscriber.Queue.Arguments sets %s, which amqpretry manages", k)
		}
	}
	if c.QueueType != QueueTypeClassic && c.QueueType != QueueTypeQuorum {
		return fmt.Errorf("amqpretry.Config.QueueType %q is neither %q nor %q", c.QueueType, QueueTypeClassic, QueueTypeQuorum)
	}
	if c.QueueType == QueueTypeQuorum && (c.Subscriber.Queue.AutoDelete || c.Subscriber.Queue.Exclusive) {
		return errors.New("amqpretry.Config.Subscriber.Queue: quorum queues cannot be auto-delete or exclusive")
	}
	if c.MaxAttempts < 1 || c.MaxAttempts > middleware.MaxAttemptsCap {
		return fmt.Errorf("amqpretry.Config.MaxAttempts %d is outside [1, %d]", c.MaxAttempts, middleware.MaxAttemptsCap)
	}
	if len(c.Tiers) > MaxTiers {
		return fmt.Errorf("amqpretry.Config.Tiers has %d tiers, more than %d", len(c.Tiers), MaxTiers)
	}
	for i, d := range c.Tiers {
		if d < time.Millisecond || d > MaxTTL {
			return fmt.Errorf("amqpretry.Config.Tiers[%d] = %v is outside [1ms, %v] (RabbitMQ's TTL range)", i, d, MaxTTL)
		}
		if d%time.Millisecond != 0 {
			return fmt.Errorf("amqpretry.Config.Tiers[%d] = %v is not a whole number of milliseconds (x-message-ttl is in ms)", i, d)
		}
	}
	if c.DelayerFactory != nil {
		switch {
		case len(c.Tiers) > 0:
			return errors.New("amqpretry.Config.Tiers is set together with DelayerFactory, which replaces the wait queues: leave Tiers empty")
		case c.DeadLetterFirstRetry:
			return errors.New("amqpretry.Config.DeadLetterFirstRetry cannot be combined with DelayerFactory: it dead-letters the first retry into the first wait queue, which DelayerFactory replaces")
		case c.NativeDelayedRetry != nil:
			return errors.New("amqpretry.Config.NativeDelayedRetry cannot be combined with DelayerFactory: each would delay short retries its own way")
		}
	}
	if c.DeadLetterFirstRetry && c.QueueType != QueueTypeQuorum {
		return errors.New("amqpretry.Config.DeadLetterFirstRetry needs QueueType quorum (classic-queue dead-lettering is at-most-once)")
	}
	if err := c.validateNative(); err != nil {
		return err
	}
	if c.ManagementURL != "" {
		if _, err := newMgmtClient(&AdoptQueue{ManagementURL: c.ManagementURL}, "ManagementURL"); err != nil {
			return err
		}
	}
	if a := c.AdoptQueue; a != nil {
		if a.ManagementURL == "" && (c.DeadLetterFirstRetry || c.NativeDelayedRetry != nil) {
			return errors.New("amqpretry.Config.AdoptQueue.ManagementURL is empty, and DeadLetterFirstRetry and NativeDelayedRetry cannot work on an adopted queue until their policy applies: set ManagementURL so the library applies and checks it")
		}
		if a.ManagementURL != "" {
			if _, err := newMgmtClient(a, "AdoptQueue.ManagementURL"); err != nil {
				return err
			}
		}
		if a.PolicyPriority < 0 {
			return fmt.Errorf("amqpretry.Config.AdoptQueue.PolicyPriority %d is negative", a.PolicyPriority)
		}
	}
	if c.PublisherChannels < 0 {
		return fmt.Errorf("amqpretry.Config.PublisherChannels %d is negative", c.PublisherChannels)
	}
	if c.ConfirmTimeout < 0 {
		return fmt.Errorf("amqpretry.Config.ConfirmTimeout %v is negative", c.ConfirmTimeout)
	}
	return nil
}

// DefaultTiers returns the tiers New uses when Config.Tiers is empty: the
// delay after each of attempts 1..maxAttempts-1 under policy, without jitter
// when policy makes an *backoff.ExponentialBackOff, clamped to [1 ms,
// MaxTTL], rounded to ms, deduplicated, ascending, at most MaxTiers. With
// maxAttempts 1 (no retries) it returns one 1 s tier, used only by the nack
// path.
func DefaultTiers(policy func() backoff.BackOff, maxAttempts int) []time.Duration {
	p := policy
	if eb, ok := policy().(*backoff.ExponentialBackOff); ok {
		p = func() backoff.BackOff {
			c := *eb
			c.RandomizationFactor = 0
			c.Reset()
			return &c
		}
	}
	var tiers []time.Duration
	for n := 1; n < maxAttempts && len(tiers) < MaxTiers; n++ {
		d, ok := middleware.BackoffDelay(p, n)
		if !ok {
			break
		}
		d = min(max(d.Round(time.Millisecond), time.Millisecond), MaxTTL)
		if !slices.Contains(tiers, d) {
			tiers = append(tiers, d)
		}
	}
	if len(tiers) == 0 {
		tiers = []time.Duration{time.Second}
	}
	slices.Sort(tiers)
	return tiers
}

// Retry is what New returns: everything needed to plug retries into a
// watermill-amqp subscriber and router.
type Retry struct {
	chain     *router.Chain
	topology  *Topology
	marshaler Marshaler
	publisher *ConfirmPublisher
	delayer   *Delayer
	// customClose: the DelayerFactory's CustomDelayer.Close, if any.
	customClose func() error
	subscriber  wamqp.Config
	// crashQuarantine: Config.CrashQuarantine.
	crashQuarantine bool
	queueName       func(ctx context.Context) string
	late            *lateVerdicts
	logger          watermill.LoggerAdapter
}

// New validates cfg, connects the retry publisher (publisher confirms) and
// assembles the chain: attempt counter, poison forwarder, delayed
// republisher, classifier. With Config.DelayerFactory it calls the
// factory once the publisher is connected and schedules positive-delay
// retries with its Delayer. It returns Config.Validate's error, a
// connection error, or the factory's error (wrapped). Close it after the
// router.
func New(cfg Config) (*Retry, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tiers := slices.Clone(cfg.Tiers)
	slices.Sort(tiers)
	tiers = slices.Compact(tiers)
	topo := newTopology(cfg.Naming, tiers, cfg.QueueType, cfg.DeadLetterFirstRetry, cfg.Logger)
	if cfg.NativeDelayedRetry != nil {
		n := *cfg.NativeDelayedRetry // a copy: later changes to cfg do not apply
		cfg.NativeDelayedRetry = &n
	}
	topo.native = cfg.NativeDelayedRetry

	inner := cfg.Subscriber.Marshaler
	switch m := inner.(type) {
	case Marshaler:
		inner = m.Inner
	case trackingMarshaler:
		inner = m.Inner
	}
	marshaler := Marshaler{Inner: inner, Topology: topo}

	pubAmqp, err := amqpConfigFromSubscriber(cfg.Subscriber.Connection)
	if err != nil {
		return nil, err
	}
	pub, err := NewConfirmPublisher(PublisherConfig{
		URI: cfg.URI, AmqpConfig: pubAmqp, ConnectionName: publisherConnectionName(cfg.Subscriber.Connection),
		Channels: cfg.PublisherChannels, ConfirmTimeout: cfg.ConfirmTimeout, Logger: cfg.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("amqpretry: connecting the retry publisher: %w", err)
	}
	if props, err := pub.serverProperties(); err == nil {
		if v, _ := props["version"].(string); classicTimeoutIgnored(v, cfg.QueueType) {
			fields := watermill.LogFields{"broker_version": v, "queue_type": cfg.QueueType}
			if t, ok := explicitConsumerTimeout(cfg.Subscriber); ok {
				fields["x_consumer_timeout"] = t
				cfg.Logger.Error("Consumer timeout set on a classic queue, which RabbitMQ 4.3+ ignores", errors.New(
					"RabbitMQ 4.3 applies consumer_timeout to quorum queues only: a hung handler holds its delivery until its connection closes; bound the handler (e.g. watermill middleware.Timeout) or use QueueType quorum"), fields)
			} else {
				cfg.Logger.Info("RabbitMQ 4.3+ applies no consumer timeout to classic queues: a hung handler holds its delivery until its connection closes; bound the handler yourself (e.g. watermill middleware.Timeout)", fields)
			}
		}
	}
	if cfg.NativeDelayedRetry != nil {
		props, err := pub.serverProperties()
		if err == nil {
			err = checkNativeSupport(props)
		}
		if err != nil {
			_ = pub.Close()
			return nil, err
		}
	}
	if cfg.AdoptQueue != nil {
		if topo.adopt, err = newAdopter(cfg.AdoptQueue, topo, cfg.URI); err != nil {
			_ = pub.Close()
			return nil, err
		}
		topo.open = pub.Channel
	}
	routes, err := newRouteChecker(cfg, topo, pub)
	if err != nil {
		_ = pub.Close()
		return nil, err
	}
	delayer := &Delayer{publisher: pub, topology: topo, marshaler: marshaler, queueName: cfg.QueueName, logger: cfg.Logger,
		deadLetterFirst: cfg.DeadLetterFirstRetry, native: cfg.NativeDelayedRetry, routes: routes}
	var chainDelayer middleware.Delayer = delayer
	var custom CustomDelayer
	if cfg.DelayerFactory != nil {
		custom, err = buildCustomDelayer(cfg.DelayerFactory, DelayerDeps{
			Publisher: pub, Marshaler: marshaler, QueueName: cfg.QueueName, Logger: cfg.Logger}, topo)
		if err != nil {
			_ = pub.Close()
			return nil, fmt.Errorf("amqpretry: Config.DelayerFactory: %w", err)
		}
		chainDelayer = splitDelayer{loopBack: delayer, custom: custom.Delayer}
	}
	chain, err := router.New(router.Config{
		Delayer:         chainDelayer,
		PoisonPublisher: &poisonPublisher{publisher: pub, topology: topo, marshaler: marshaler, logger: cfg.Logger},
		PoisonTopic:     func(ctx context.Context) string { return topo.PoisonQueue(cfg.QueueName(ctx)) },
		MaxAttempts:     cfg.MaxAttempts,
		MaxRedeliveries: cfg.MaxRedeliveries,
		FallbackPause:   cfg.FallbackPause,
		Backoff:         cfg.Backoff,
		Classifier:      classifierWithAlive(cfg.Classifier),
		QueueName:       cfg.QueueName,
		ErrorText:       cfg.ErrorText,
		Observer:        cfg.Observer,
		Logger:          cfg.Logger,
		Pause:           cfg.Pause,
		Tracing:         cfg.Tracing,

		// The router's default sources, the same in every mode; with native
		// delayed retry every redelivery (crashes too) is an attempt,
		// counted by x-acquired-count.
		RedeliveriesCounted: cfg.NativeDelayedRetry != nil,
	})
	if err != nil {
		if custom.Close != nil {
			_ = custom.Close()
		}
		_ = pub.Close()
		return nil, err
	}

	sub := cfg.Subscriber
	sub.TopologyBuilder = topo
	sub.Marshaler = trackingMarshaler{marshaler}
	// The chain nacks only what it could not settle, after a pause, and wants
	// it requeued (kept in Q; the RedeliveryGuard counts the redelivery), not
	// dead-lettered: classic dead-lettering is at-most-once. With
	// DeadLetterFirstRetry the nack is the first retry: Q's DLX takes it.
	sub.Consume.NoRequeueOnNack = cfg.DeadLetterFirstRetry
	if cfg.QueueType == QueueTypeQuorum {
		sub.Queue.Durable = true
	}
	return &Retry{crashQuarantine: cfg.CrashQuarantine, chain: chain, topology: topo, marshaler: marshaler, publisher: pub, delayer: delayer,
		customClose: custom.Close, subscriber: sub, queueName: cfg.QueueName, late: newLateVerdicts(), logger: cfg.Logger}, nil
}

// Middleware is the retry chain; pass it to (*message.Router).AddMiddleware
// or (*message.Handler).AddMiddleware.
//
// It also tells the chain whether a message's delivery can still be acked
// (its channel open, its consumer not cancelled by the broker): a failure
// on a delivery the broker has already taken back is neither retried nor
// poisoned (middleware.ActionNack), since the broker redelivers it. Such
// deliveries are taken back on a consumer timeout ("Delivery
// Acknowledgement Timeout": on RabbitMQ 4.x the consumer is cancelled and
// every unacked delivery returned; a late ack is void), a closed channel
// or a lost connection. Two consequences are handled here:
//   - a delivery taken back before its handler started (it sat in the
//     prefetch buffer) is not run: the router nacks it (void) and the
//     broker's redelivery runs instead, so a slow neighbour does not make
//     the other prefetched messages run twice;
//   - a handler that finished after its delivery was taken back has its
//     result remembered (the last 4096 such messages, in this process):
//     when the broker redelivers that message here, the handler does not
//     run again; the remembered result is settled instead (a success
//     acked, a failure retried or poisoned as usual), and the redelivery
//     is not counted as a crash. Another process runs it again
//     (at-least-once).
func (r *Retry) Middleware(h message.HandlerFunc) message.HandlerFunc {
	inner := r.chain.Middleware(recordVerdict(h))
	return func(msg *message.Message) ([]*message.Message, error) {
		// The healthy path stays small (no logging fields, no key built, a
		// small frame): it runs on a fresh goroutine per message.
		st := beginRun(msg)
		if !st.alive() {
			return nil, errDeliveryGone
		}
		if r.delayer.deadLetterFirst || msg.Metadata[middleware.DeliveryRedeliveredKey] != "" {
			r.beforeRun(msg, st)
		}
		out, err := inner(msg)
		if !st.alive() {
			r.afterRun(msg, st)
		}
		return out, err
	}
}

// beforeRun marks foreign x-death entries (DeadLetterFirstRetry) and, on a
// redelivery, takes a result remembered by lateVerdicts for the run to
// settle instead of running the handler.
//
//go:noinline
func (r *Retry) beforeRun(msg *message.Message, st *runState) {
	if r.delayer.deadLetterFirst && msg.Metadata.Get(middleware.XDeathKey) != "" {
		if ctx := msg.Context(); foreignDeaths(msg, r.queueName(ctx)) {
			msg.SetContext(context.WithValue(ctx, foreignDeathsKey{}, true))
		}
	}
	if msg.Metadata.Get(middleware.DeliveryRedeliveredKey) != "" {
		if err, ok := r.late.take(st.key()); ok {
			// Its redelivery is explained: the handler ran here and
			// finished after the broker took the delivery back.
			r.logger.Info("Redelivered message already ran here after its delivery was taken back (consumer timeout?); settling that result without running it again",
				watermill.LogFields{"message_uuid": msg.UUID, "attempt": st.attempt})
			delete(msg.Metadata, middleware.DeliveryRedeliveredKey)
			st.mu.Lock()
			st.replay, st.replayErr = true, err
			st.mu.Unlock()
		}
	}
}

// afterRun remembers the result of a handler that finished after the
// broker took its delivery back.
//
//go:noinline
func (r *Retry) afterRun(msg *message.Message, st *runState) {
	if v, ran := st.verdict(); ran {
		r.late.add(st.key(), v.err)
		r.logger.Info("Handler finished after the broker took its delivery back (consumer timeout?); its redelivery will settle this result without running again",
			watermill.LogFields{"message_uuid": msg.UUID, "attempt": st.attempt})
	}
}

// Chain returns the assembled middlewares.
func (r *Retry) Chain() *router.Chain { return r.chain }

// SubscriberConfig returns Config.Subscriber with TopologyBuilder set to the
// retry Topology, Marshaler set to the x-death-aware Marshaler and
// Consume.NoRequeueOnNack set (a nack dead-letters into the wait path instead
// of requeueing at once). Pass it to wamqp.NewSubscriber.
func (r *Retry) SubscriberConfig() wamqp.Config { return r.subscriber }

// NewSubscriber returns a watermill-amqp subscriber on SubscriberConfig,
// wrapped in a router.DrainingSubscriber so that stopping the router (by
// cancelling the context of message.Router.Run, or by Router.Close) lets
// in-flight handlers finish (and their messages be acked, retried or
// poisoned) before the subscriber closes, instead of watermill-amqp's nack
// of every in-flight delivery; an idle router stops at once. drainTimeout
// bounds that wait (0: 20 s); keep it below the router's CloseTimeout
// (Watermill's default 30 s). Once Run's context has ended the subscriber
// closes itself; Close it anyway (it returns the drain's result). It returns
// watermill-amqp's error.
//
// With Config.CrashQuarantine, each subscription also consumes the
// originating queue's quarantine queue
// (Naming.QuarantineQueue) with prefetch 1, on a second connection (its
// connection_name, if set, gets ".quarantine" appended), and hands its
// messages to the same handler: the RedeliveryGuard moves a redelivered
// message there so that a crash is counted against the message that
// crashed, not against the others the consumer held (see
// middleware.RedeliveryGuard). A subscriber built from SubscriberConfig
// alone does not consume the quarantine; the guard then counts every
// redelivery in the originating queue, as before.
func (r *Retry) NewSubscriber(logger watermill.LoggerAdapter, drainTimeout time.Duration) (*router.DrainingSubscriber, error) {
	if !r.crashQuarantine {
		sub, err := wamqp.NewSubscriber(r.subscriber, logger)
		if err != nil {
			return nil, err
		}
		return router.NewDrainingSubscriber(sub, drainTimeout), nil
	}
	sub, err := newQuarantineSubscriber(r.subscriber, r.topology, logger)
	if err != nil {
		return nil, err
	}
	return router.NewDrainingSubscriber(sub, drainTimeout), nil
}

// Topology returns the topology builder (names, tiers, TierFor).
func (r *Retry) Topology() *Topology { return r.topology }

// Marshaler returns the x-death-aware Marshaler.
func (r *Retry) Marshaler() Marshaler { return r.marshaler }

// Publisher returns the confirm publisher used for retries and poison.
func (r *Retry) Publisher() *ConfirmPublisher { return r.publisher }

// QueueName returns the originating queue for a subscribe topic.
func (r *Retry) QueueName(topic string) string { return r.subscriber.Queue.GenerateName(topic) }

// DeleteQueues deletes originating queue queue together with its wait
// queues, poison queue and quarantine queue, with every message in them (queue.delete, unconditional;
// a missing queue is not an error). The shared exchanges stay. Meant for
// demos, tests and decommissioning; it returns the first broker error.
func (r *Retry) DeleteQueues(queue string) error {
	ch, err := r.publisher.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	for _, q := range append([]string{queue}, r.topology.sideQueues(queue)...) {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return fmt.Errorf("amqpretry: deleting queue %q: %w", q, err)
		}
	}
	return nil
}

// Close closes the Config.DelayerFactory's delayer (CustomDelayer.Close), if
// any, then the retry publisher, waiting for publishes in flight, and
// returns their errors joined. Close the router first.
func (r *Retry) Close() error {
	var cerr error
	if r.customClose != nil {
		cerr = r.customClose()
	}
	return errors.Join(cerr, r.publisher.Close())
}

// Delayer implements middleware.Delayer on RabbitMQ: it publishes the copy to
// the wait queue of the tier TierFor(delay) of the message's originating
// queue, with mandatory set, and returns once the broker confirmed it.
type Delayer struct {
	publisher *ConfirmPublisher
	topology  *Topology
	marshaler Marshaler
	queueName func(ctx context.Context) string
	logger    watermill.LoggerAdapter
	// deadLetterFirst: first-tier retries are left to Q's dead-letter path.
	deadLetterFirst bool
	// native: retries within its range are left to Q's delayed retry.
	native *NativeDelayedRetry
	// routes checks the broker-side route before deadLetterFirst or native
	// relies on it (nil: nothing to check).
	routes *routeChecker
}

// Schedule publishes msg to its wait queue and waits for the confirm. A copy
// whose headers exceed MaxCopyHeaderBytes is refused with an error wrapping
// middleware.ErrCannotDelay (the message is then poisoned). With
// Config.DeadLetterFirstRetry, a first-tier retry returns
// middleware.ErrDeadLetter without publishing, unless the message carries
// delivery carries x-death entries for Q that did not come from its way back
// to Q (a producer's: foreignDeaths, marked by Retry.Middleware), which the
// dead-letter path would keep; with
// Config.NativeDelayedRetry, a retry in its range (NativeDelayedRetry) returns
// middleware.ErrNativeRetry without publishing; either only while the
// route checks out (see Config.DeadLetterFirstRetry) and ctx is not
// middleware.WithCopyRequired, else it publishes. The
// tier is TierFor(delay), or, when ctx carries a middleware.MinimumDelay (a
// handler's RetryAfter), the smallest tier at or above it. A delay (or
// RetryAfter) longer than the longest tier is held for the longest tier, and
// the copy carries the rest (middleware.SetRemainingDelay): the
// RedeliveryGuard sends it round again when it comes back, as many times as
// needed, so the next attempt never runs earlier than asked. If the
// wait queue or exchange is missing (returned as unroutable, or 404
// NOT_FOUND), it redeclares the queue's topology and tries once more, so the
// nack that follows a failure still finds the dead-letter path. It does not
// stop when ctx is cancelled (router shutdown): the publish is bounded by the
// publisher's ConfirmTimeout instead, so a retry in flight is not lost to a
// shutdown.
func (d *Delayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	q := d.queueName(ctx)
	if err := d.topology.CheckNames(q); err != nil {
		return err
	}
	tier := d.topology.TierFor(delay)
	asked := delay
	minimum, hasMinimum := middleware.MinimumDelay(ctx)
	if hasMinimum {
		// A handler's RetryAfter is a floor: round up, never down.
		asked = max(delay, minimum)
		tier, _ = d.topology.TierAtLeast(asked)
	}
	if delay <= 0 {
		// Straight back to Q (the RedeliveryGuard's and the fallback's
		// copies), with whatever remaining delay the copy's maker set.
		return d.publish(ctx, msg, d.topology.naming.LoopBackExchange, q, q)
	}
	// Beyond the longest tier, the wait queue holds the copy for that tier
	// and the copy carries the rest (middleware.RemainingDelayKey): the
	// RedeliveryGuard sends it round again, so it never runs earlier than
	// asked. Within the tiers a backoff delay is rounded to the nearest tier
	// (TierFor), a RetryAfter up (TierAtLeast).
	var remaining time.Duration
	if n := len(d.topology.tiers); n > 0 && asked > d.topology.tiers[n-1] {
		longest := d.topology.tiers[n-1]
		remaining = asked - longest
		d.logger.Debug("Retry delay exceeds the longest tier; held in several hops", watermill.LogFields{
			"queue": q, "requested": asked.String(), "tier": tier.String(), "remaining": remaining.String(),
		})
	}
	middleware.SetRemainingDelay(msg.Metadata, remaining)
	if d.native != nil && !middleware.CopyRequired(ctx) {
		if d.native.fits(delay, minimum) && d.routes.usable(q) {
			return middleware.ErrNativeRetry // the nack with requeue puts it into Q's delayed state
		}
	}
	if d.deadLetterFirst && remaining == 0 && tier == d.topology.tiers[0] && !middleware.CopyRequired(ctx) &&
		ctx.Value(foreignDeathsKey{}) == nil && d.routes.usable(q) {
		// The dead-lettered original carries no header: only a delay the
		// first tier holds in full takes this path.
		return middleware.ErrDeadLetter // Q's DLX routes to the first wait queue
	}
	wq := d.topology.naming.WaitQueue(q, tier)
	return d.publish(ctx, msg, d.topology.naming.WaitExchange, wq, q)
}

// foreignDeathsKey marks, in a delivery's context (Retry.Middleware), a
// delivery with foreignDeaths: its first-tier retry is a published copy,
// not the dead-letter path.
type foreignDeathsKey struct{}

// foreignDeaths reports whether msg carries x-death entries for q that the
// broker did not write on the way back to q (a producer's, or copied from
// another message): the message is not on a retry route
// (middleware.DeliveryRetryRouteKey). The dead-letter path would keep them
// (RabbitMQ 3.x adds its own count to an x-death entry the message already
// has), so that such a message's next delivery, back through the first wait
// queue, would count them as attempts; a published copy, whose x-death is
// stripped, counts only the attempts made here.
func foreignDeaths(msg *message.Message, q string) bool {
	if msg.Metadata.Get(middleware.DeliveryRetryRouteKey) == "true" {
		return false
	}
	recs, err := middleware.ParseXDeath(msg.Metadata.Get(middleware.XDeathKey))
	if err != nil {
		return true
	}
	for _, r := range recs {
		if r.Queue == q {
			return true
		}
	}
	return false
}

// publish marshals msg and publishes it to exchange with key (mandatory,
// confirmed); if the target is missing it redeclares q's topology and tries
// once more.
func (d *Delayer) publish(ctx context.Context, msg *message.Message, exchange, key, q string) error {
	p, err := d.marshaler.Marshal(msg)
	if err != nil {
		return fmt.Errorf("amqpretry: marshaling retry copy: %w", err)
	}
	if n := encodedHeaderBytes(p.Headers); n > MaxCopyHeaderBytes {
		return fmt.Errorf("%w: the retry copy's headers take about %d bytes, more than the %d that stay deliverable once the broker adds x-death",
			middleware.ErrCannotDelay, n, MaxCopyHeaderBytes)
	}
	pctx := context.WithoutCancel(ctx)
	err = d.publisher.PublishRaw(pctx, exchange, key, p)
	if err == nil || !topologyMissing(err) {
		return err
	}
	d.logger.Error("Retry publish found no route; redeclaring topology", err, watermill.LogFields{"queue": q, "exchange": exchange, "routing_key": key})
	if rerr := d.topology.Redeclare(d.publisher.Channel, q); rerr != nil {
		return errors.Join(err, fmt.Errorf("amqpretry: redeclaring topology of %q: %w", q, rerr))
	}
	return d.publisher.PublishRaw(pctx, exchange, key, p)
}

// publisherConnectionName is the retry publisher's connection_name: the
// subscriber's own name with ".retry-publisher" appended when it sets one
// (so an operator sees which service a publisher belongs to), else
// DefaultPublisherConnectionName.
func publisherConnectionName(c wamqp.ConnectionConfig) string {
	if c.AmqpConfig != nil {
		if name, ok := c.AmqpConfig.Properties["connection_name"].(string); ok && name != "" {
			return name + ".retry-publisher"
		}
	}
	return DefaultPublisherConnectionName
}

// classifierWithAlive adds deliveryAlive to c.DeliveryAlive.
func classifierWithAlive(c middleware.ClassifierConfig) middleware.ClassifierConfig {
	user := c.DeliveryAlive
	c.DeliveryAlive = func(msg *message.Message) bool {
		return deliveryAlive(msg) && (user == nil || user(msg))
	}
	return c
}

func topologyMissing(err error) bool {
	if errors.Is(err, ErrUnroutable) {
		return true
	}
	var aerr *amqp.Error
	return errors.As(err, &aerr) && aerr.Code == amqp.NotFound
}

// poisonPublisher publishes to the poison exchange with confirms; the topic is
// the poison queue name (its binding key). A copy too large for a frame loses
// its largest user headers first (fitHeaders). If the poison queue is missing, it
// redeclares the originating queue's topology (named by OriginalQueueKey) and
// tries once more; a failure is returned, so the original is nacked.
type poisonPublisher struct {
	publisher *ConfirmPublisher
	topology  *Topology
	marshaler Marshaler
	logger    watermill.LoggerAdapter
}

func (p *poisonPublisher) Publish(topic string, msgs ...*message.Message) error {
	ps := make([]amqp.Publishing, 0, len(msgs))
	for _, m := range msgs {
		pub, err := p.marshaler.Marshal(m)
		if err != nil {
			return fmt.Errorf("amqpretry: marshaling poison copy: %w", err)
		}
		fitHeaders(&pub)
		ps = append(ps, pub)
	}
	ex := p.topology.naming.PoisonExchange
	err := p.publisher.PublishRawBatch(context.Background(), ex, topic, ps)
	if err == nil || !topologyMissing(err) || len(msgs) == 0 {
		return err
	}
	q := msgs[0].Metadata.Get(middleware.OriginalQueueKey)
	p.logger.Error("Poison publish found no poison queue; redeclaring topology", err, watermill.LogFields{"queue": q, "poison_queue": topic})
	if rerr := p.topology.Redeclare(p.publisher.Channel, q); rerr != nil {
		return errors.Join(err, fmt.Errorf("amqpretry: redeclaring topology of %q: %w", q, rerr))
	}
	return p.publisher.PublishRawBatch(context.Background(), ex, topic, ps)
}

func (p *poisonPublisher) Close() error { return nil }
