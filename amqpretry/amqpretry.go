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

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
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
	// timeout, vhost, SASL, client properties; see confirm.Config.AmqpConfig),
	// under its own connection_name (the subscriber's connection_name +
	// ".retry-publisher", else confirm's default, "rabbitretry-confirm-publisher"). Setting
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
	// Policy is the retry policy, the chain's settings (MaxAttempts,
	// Backoff, Classifier, QueueName, ErrorText, MaxRedeliveries,
	// FallbackPause, Pause, Tracing, Observer): see router.Policy, whose
	// defaults apply, except QueueName, which defaults to
	// Subscriber.Queue.GenerateName(message.SubscribeTopicFromCtx(ctx)). The
	// same value configures a broker-free test chain (router.Config.Policy).
	// With the crash quarantine (the default), MaxRedeliveries counts in the quarantine queue,
	// where a crash is attributable; FallbackPause applies to a retry or
	// poison copy the broker did not confirm.
	router.Policy
	// Mode is the retry mode: how a retry with a positive delay waits
	// (Tiers, DeadLetterFirst, NativeDelayed, Custom; see Mode). Default
	// Tiers() (wait queues at DefaultTiers of Backoff and MaxAttempts).
	Mode Mode
	// Naming of exchanges and queues. Defaults in Naming.
	Naming Naming
	// DisableCrashQuarantine turns off the crash quarantine, which is on by
	// default: Retry.NewSubscriber also consumes each queue's quarantine
	// queue (Naming.QuarantineQueue), so that a crash is counted against the
	// message that crashed, not against the neighbours the consumer held
	// (with prefetch N a crash returns up to N deliveries, all flagged
	// redelivered; RabbitMQ 4.x raises x-delivery-count and
	// x-acquired-count for each). The RedeliveryGuard moves a redelivered
	// message there, where it runs alone, fetched one at a time (basic.get)
	// only while nothing else runs; a graceful stop never returns a
	// quarantined message it had not started (see Retry.NewSubscriber).
	// Disabled, every redelivery counts in the originating queue: use
	// prefetch 1 where crashes are likely. Default false (quarantine on).
	DisableCrashQuarantine bool
	// ManagementURL is the RabbitMQ management HTTP API's base URL with
	// credentials, e.g. "http://guest:guest@127.0.0.1:15672", used to check
	// the broker-side routes of the DeadLetterFirst and NativeDelayed modes
	// against the current policies and operator policies (GET
	// /api/policies/{vhost}, /api/operator-policies/{vhost}; see
	// DeadLetterFirst). Empty: AdoptQueue.ManagementURL, if any; with
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
	// PublisherChannels is the number of AMQP channels used for republishing.
	// Default 2.
	PublisherChannels int
	// ConfirmTimeout bounds the wait for a publisher confirm, and every
	// socket write of the retry publisher (confirm.Config.ConfirmTimeout).
	// While the broker blocks publishers (a memory or disk alarm, RabbitMQ
	// "Blocked Connection Notifications") retry and poison publishes fail at
	// once with ErrBlocked instead. Default 30 s.
	ConfirmTimeout time.Duration
	// HandlerDeadline puts a deadline on each handler's context, below the
	// originating queue's effective consumer timeout, so that a handler
	// that runs too long ends as a counted retry before the broker takes
	// its delivery back (see HandlerDeadline). Default: on, with the
	// margins HandlerDeadline gives.
	HandlerDeadline HandlerDeadline
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
	p := &c.Policy // router.New fills in the same defaults
	retrymeta.FillPolicyDefaults(&p.MaxAttempts, &p.Backoff, &p.MaxRedeliveries, &p.FallbackPause)
	if c.Mode == nil {
		c.Mode = Tiers()
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
	if err := c.validateSubscriber(); err != nil {
		return err
	}
	if c.MaxAttempts < 1 || c.MaxAttempts > middleware.MaxAttemptsCap {
		return fmt.Errorf("amqpretry.Config.MaxAttempts %d is outside [1, %d]", c.MaxAttempts, middleware.MaxAttemptsCap)
	}
	if err := c.mode().validate(&c); err != nil {
		return err
	}
	if err := c.validateManagement(); err != nil {
		return err
	}
	if err := c.HandlerDeadline.validate(); err != nil {
		return err
	}
	if c.PublisherChannels < 0 {
		return fmt.Errorf("amqpretry.Config.PublisherChannels %d is negative", c.PublisherChannels)
	}
	if c.ConfirmTimeout < 0 {
		return fmt.Errorf("amqpretry.Config.ConfirmTimeout %v is negative", c.ConfirmTimeout)
	}
	return nil
}

// validateSubscriber checks URI, Subscriber and QueueType.
func (c Config) validateSubscriber() error {
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
	return nil
}

// validateManagement checks ManagementURL and AdoptQueue.
func (c Config) validateManagement() error {
	if c.ManagementURL != "" {
		if _, err := newMgmtClient(&AdoptQueue{ManagementURL: c.ManagementURL}, "ManagementURL"); err != nil {
			return err
		}
	}
	a := c.AdoptQueue
	if a == nil {
		return nil
	}
	if a.ManagementURL != "" {
		if _, err := newMgmtClient(a, "AdoptQueue.ManagementURL"); err != nil {
			return err
		}
	}
	if a.PolicyPriority < 0 {
		return fmt.Errorf("amqpretry.Config.AdoptQueue.PolicyPriority %d is negative", a.PolicyPriority)
	}
	return nil
}

// DefaultTiers returns the tiers of a mode given none (Tiers()): the
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
		d, ok := retrymeta.BackoffDelay(p, n)
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
	publisher *confirm.Publisher
	// modeClose: the Mode's close (Custom: CustomDelayer.Close), if any.
	modeClose  func() error
	subscriber wamqp.Config
	// delayer: the tiers Delayer every mode builds on; the quarantine's
	// hand-back publishes through it.
	delayer *tiersDelayer
	// noQuarantine: Config.DisableCrashQuarantine.
	noQuarantine bool
	queueName    func(ctx context.Context) string
	late         *lateVerdicts
	deadlines    *deadlines // nil: HandlerDeadline.Disabled
	logger       watermill.LoggerAdapter
}

// New validates cfg, connects the retry publisher (publisher confirms) and
// assembles the chain: attempt counter, poison forwarder, delayed
// republisher, classifier, with the Delayer of Config.Mode (the Custom
// mode's factory is called once the publisher is connected). It returns
// Config.Validate's error, a connection error, or the mode's error (the
// native mode's on a broker older than 4.3, the factory's, wrapped). Close it after the
// router.
func New(cfg Config) (*Retry, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	mode := cfg.Mode
	topo := newTopology(cfg.Naming, nil, cfg.QueueType, false, cfg.Logger)
	mode.configure(&cfg, topo)

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
	pub, err := confirm.New(confirm.Config{
		URI: cfg.URI, AmqpConfig: pubAmqp, ConnectionName: publisherConnectionName(cfg.Subscriber.Connection),
		Channels: cfg.PublisherChannels, ConfirmTimeout: cfg.ConfirmTimeout, Logger: cfg.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("amqpretry: connecting the retry publisher: %w", err)
	}
	var brokerVersion string
	if props, err := serverProperties(pub); err == nil {
		brokerVersion, _ = props["version"].(string)
		if v := brokerVersion; classicTimeoutIgnored(v, cfg.QueueType) {
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
	dl, err := newDeadlines(cfg, brokerVersion)
	if err != nil {
		_ = pub.Close()
		return nil, err
	}
	if dl != nil {
		topo.onBuilt = func(q string) { dl.resolve(q) }
	}
	delayer := &tiersDelayer{publisher: pub, topology: topo, marshaler: marshaler, queueName: cfg.QueueName, logger: cfg.Logger, routes: routes}
	chainDelayer, modeClose, err := mode.delayer(delayer, DelayerDeps{
		Publisher: pub, Marshaler: marshaler, QueueName: cfg.QueueName, Logger: cfg.Logger})
	if err != nil {
		_ = pub.Close()
		return nil, err
	}
	policy := cfg.Policy
	policy.Classifier = classifierWithAlive(policy.Classifier)
	chain, err := router.New(router.Config{
		Policy:          policy,
		Delayer:         chainDelayer,
		PoisonPublisher: &poisonPublisher{publisher: pub, topology: topo, marshaler: marshaler, logger: cfg.Logger},
		PoisonTopic:     func(ctx context.Context) string { return topo.naming.PoisonQueue(cfg.QueueName(ctx)) },
		Logger:          cfg.Logger,

		// The same sources in every mode; with native delayed retry every
		// redelivery (crashes too) is an attempt, counted by
		// x-acquired-count.
		AttemptSources: amqpwire.Sources(func(msg *message.Message) string { return cfg.QueueName(msg.Context()) },
			topo.native != nil),
		RedeliveriesCounted: topo.native != nil,
	})
	if err != nil {
		if modeClose != nil {
			_ = modeClose()
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
	// DeadLetterFirst the nack is the first retry: Q's DLX takes it.
	sub.Consume.NoRequeueOnNack = topo.deadLetterFirst
	if cfg.QueueType == QueueTypeQuorum {
		sub.Queue.Durable = true
	}
	return &Retry{noQuarantine: cfg.DisableCrashQuarantine, delayer: delayer, chain: chain, topology: topo, marshaler: marshaler, publisher: pub,
		modeClose: modeClose, subscriber: sub, queueName: cfg.QueueName, late: newLateVerdicts(), deadlines: dl, logger: cfg.Logger}, nil
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
//
// Before either happens, the handler's context carries the queue's
// deadline (Config.HandlerDeadline): a handler that honours it fails in
// time for its retry to be counted and the delivery acked.
func (r *Retry) Middleware(h message.HandlerFunc) message.HandlerFunc {
	inner := r.chain.Middleware(recordVerdict(r.deadlines, r.queueName, h))
	return func(msg *message.Message) ([]*message.Message, error) {
		// The healthy path stays small (no logging fields, no key built, a
		// small frame): it runs on a fresh goroutine per message, whose
		// stack is copied when it grows (see recordVerdict).
		st, err := r.begin(msg)
		if err != nil {
			return nil, err
		}
		return st.end(inner(msg))
	}
}

// end is the run's last step, with the chain's results: a run that
// outlived its delivery keeps its verdict for the redelivery (afterRun).
//
//go:noinline
func (st *runState) end(out []*message.Message, err error) ([]*message.Message, error) {
	if !st.alive() {
		st.retry.afterRun(st.msg, st)
	}
	return out, err
}

// begin starts msg's run (its run state, its handler deadline, the
// quarantine and redelivery checks). Nothing runs, and nothing is copied,
// for a message whose delivery is already gone (errDeliveryGone) or whose
// context ended before the chain got it (errStopping). Out of line:
// Middleware's frame stays small.
//
//go:noinline
func (r *Retry) begin(msg *message.Message) (*runState, error) {
	if msg.Context().Err() != nil {
		return nil, errStopping
	}
	st := beginRun(msg)
	if !st.alive() {
		return nil, errDeliveryGone
	}
	st.msg, st.retry = msg, r
	if r.deadlines != nil {
		r.deadlines.prepare(st, r.queueName(msg.Context()))
	}
	if msg.Metadata[retrymeta.DeliveryQuarantineKey] != "" {
		// A quarantine delivery's retry is a published copy: a nack of
		// it would not dead-letter into Q's wait path (the quarantine
		// queue has no such route), and the quarantine subscriber hands
		// a nacked delivery back unchanged (see Retry.NewSubscriber).
		msg.SetContext(retrymeta.WithCopyRequired(msg.Context()))
	}
	if r.topology.deadLetterFirst || msg.Metadata[retrymeta.DeliveryRedeliveredKey] != "" {
		r.beforeRun(msg, st)
	}
	return st, nil
}

// beforeRun marks foreign x-death entries (DeadLetterFirstRetry) and, on a
// redelivery, takes a result remembered by lateVerdicts for the run to
// settle instead of running the handler.
//
//go:noinline
func (r *Retry) beforeRun(msg *message.Message, st *runState) {
	if r.topology.deadLetterFirst && msg.Metadata.Get(middleware.XDeathKey) != "" {
		if ctx := msg.Context(); foreignDeaths(msg, r.queueName(ctx)) {
			msg.SetContext(context.WithValue(ctx, foreignDeathsKey{}, true))
		}
	}
	if msg.Metadata.Get(retrymeta.DeliveryRedeliveredKey) != "" {
		if err, ok := r.late.take(st.key()); ok {
			// Its redelivery is explained: the handler ran here and
			// finished after the broker took the delivery back.
			r.logger.Info("Redelivered message already ran here after its delivery was taken back (consumer timeout?); settling that result without running it again",
				watermill.LogFields{"message_uuid": msg.UUID, "attempt": st.attempt})
			delete(msg.Metadata, retrymeta.DeliveryRedeliveredKey)
			st.mu.Lock()
			st.replayErr = err
			st.replay.Store(true)
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

// Topology returns the topology builder (names, tiers, TierFor).
func (r *Retry) Topology() *Topology { return r.topology }

// Publisher returns the confirm publisher used for retries and poison.
func (r *Retry) Publisher() *confirm.Publisher { return r.publisher }

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

// Close closes the Custom mode's delayer (CustomDelayer.Close), if
// any, then the retry publisher, waiting for publishes in flight, and
// returns their errors joined. Close the router first.
func (r *Retry) Close() error {
	var cerr error
	if r.modeClose != nil {
		cerr = r.modeClose()
	}
	return errors.Join(cerr, r.publisher.Close())
}

// publisherConnectionName is the retry publisher's connection_name: the
// subscriber's own name with ".retry-publisher" appended when it sets one
// (so an operator sees which service a publisher belongs to), else "",
// which confirm.Config defaults to "rabbitretry-confirm-publisher".
func publisherConnectionName(c wamqp.ConnectionConfig) string {
	if c.AmqpConfig != nil {
		if name, ok := c.AmqpConfig.Properties["connection_name"].(string); ok && name != "" {
			return name + ".retry-publisher"
		}
	}
	return ""
}

// classifierWithAlive adds deliveryAlive to c.DeliveryAlive.
func classifierWithAlive(c middleware.ClassifierConfig) middleware.ClassifierConfig {
	user := c.DeliveryAlive
	c.DeliveryAlive = func(msg *message.Message) bool {
		return deliveryAlive(msg) && (user == nil || user(msg))
	}
	return c
}
