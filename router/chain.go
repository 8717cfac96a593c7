package router

import (
	"context"
	"errors"
	"reflect"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Config configures the retry chain. Zero values take the defaults of the
// middleware they belong to.
type Config struct {
	// Delayer holds retry copies (amqpretry's wait queues, or
	// middleware.MemoryDelayer for gochannel). Required.
	Delayer middleware.Delayer
	// PoisonPublisher receives poisoned messages; Publish must return only
	// once the message is durably stored. Required. A Watermill
	// gochannel.GoChannel (tests) must be created with Persistent: true:
	// Validate refuses one without, which would drop a poisoned message
	// published before anything subscribed to the poison topic.
	PoisonPublisher message.Publisher
	// PoisonTopic names the poison topic per message. Default "poison".
	PoisonTopic func(ctx context.Context) string
	// Policy is the retry policy (attempts, backoff, classification,
	// error text, redeliveries, fallback pause, Pause, Tracing, Observer),
	// shared with amqpretry.Config. Defaults: see its fields.
	Policy
	// AttemptSources are summed into the attempt number. Default: the
	// attempt header of the library's own copies for QueueName
	// (middleware.HeaderSource), the broker-agnostic count. amqpretry.New
	// adds the broker's counts (package amqpwire): x-death rejections from
	// QueueName on deliveries back through a retry route
	// (amqpwire.XDeathSource) and the broker's count of returns
	// (amqpwire.NackCountSource, or amqpwire.AcquiredCountSource with
	// RedeliveriesCounted); see amqpwire.Sources. Counts a producer or
	// another queue's chain wrote never count. An unproven source
	// (middleware.AttemptSource.Proven) cannot alone poison a message
	// without running it: past MaxAttempts only by its count, it runs once
	// more as the last attempt.
	AttemptSources []middleware.AttemptSource
	// RedeliveriesCounted: AttemptSources count every broker redelivery as
	// an attempt (amqpwire.AcquiredCountSource), so the RedeliveryGuard
	// lets redelivered messages run (see
	// middleware.RedeliveryGuardConfig.RedeliveriesCounted) and
	// MaxRedeliveries is not used. Default false.
	RedeliveriesCounted bool
	// Logger receives structured logs (use watermill.NewSlogLogger for slog).
	// Default NopLogger.
	Logger watermill.LoggerAdapter
}

// Validate reports the first bad field. The middlewares' own Validate run
// in New after defaults are filled in.
func (c Config) Validate() error {
	if c.Delayer == nil {
		return errors.New("router.Config.Delayer is nil")
	}
	if c.PoisonPublisher == nil {
		return errors.New("router.Config.PoisonPublisher is nil")
	}
	if volatileGoChannel(c.PoisonPublisher) {
		return errors.New("router.Config.PoisonPublisher is a gochannel.GoChannel without Persistent: " +
			"it silently drops a poisoned message when nothing subscribes to the poison topic yet; " +
			"create it with gochannel.Config{Persistent: true}")
	}
	return nil
}

// volatileGoChannel reports whether p is a Watermill gochannel.GoChannel
// made without Config.Persistent. Such a GoChannel's Publish returns nil for a
// topic nobody subscribes to and discards the message ("No subscribers to
// send message"), which breaks the PoisonPublisher contract (Publish returns
// nil only once the message is stored): the original would be acked and the
// poisoned message lost. A persistent GoChannel keeps every message for later
// subscribers. GoChannel does not export its config, so this reads the
// Persistent flag (set once, in NewGoChannel, never written again) by
// reflection; TestNewRefusesVolatileGoChannelPoison fails if a Watermill
// upgrade renames it.
func volatileGoChannel(p message.Publisher) bool {
	g, ok := p.(*gochannel.GoChannel)
	if !ok || g == nil {
		return false
	}
	persistent := reflect.ValueOf(g).Elem().FieldByName("config").FieldByName("Persistent")
	return persistent.IsValid() && persistent.Kind() == reflect.Bool && !persistent.Bool()
}

// Chain is the assembled retry chain.
type Chain struct {
	Counter     *middleware.AttemptCounter
	Forwarder   *middleware.PoisonForwarder
	Guard       *middleware.RedeliveryGuard
	Republisher *middleware.Republisher
	Classifier  *middleware.Classifier
	// Pause is nil unless Config.Pause was set.
	Pause *middleware.Pause
	// Tracing is nil unless Config.Tracing was set.
	Tracing  *middleware.Tracing
	fallback *fallback
}

// New builds the chain. It returns the first configuration error, naming the
// bad field.
func New(cfg Config) (*Chain, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Policy = cfg.Policy.withDefaults()
	queueName := cfg.QueueName
	if queueName == nil {
		queueName = message.SubscribeTopicFromCtx
	}
	tracing := cfg.newTracing(queueName)
	sources := cfg.AttemptSources
	if len(sources) == 0 {
		// The broker-agnostic count: this queue's chain's attempt header.
		// The broker's own counts come from the transport's package
		// (amqpretry.New passes amqpwire.Sources).
		qn := func(msg *message.Message) string { return queueName(msg.Context()) }
		sources = []middleware.AttemptSource{middleware.HeaderSource(qn)}
	}
	counter, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: sources, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	ccfg := cfg.Classifier
	if ccfg.Logger == nil {
		ccfg.Logger = cfg.Logger
	}
	if ccfg.Observer == nil {
		ccfg.Observer = cfg.Observer
	}
	classifier, err := middleware.NewClassifier(ccfg)
	if err != nil {
		return nil, err
	}
	rep, err := middleware.NewRepublisher(middleware.RepublisherConfig{
		Delayer: cfg.Delayer, MaxAttempts: cfg.MaxAttempts, Backoff: cfg.Backoff,
		QueueName: queueName, ErrorText: cfg.ErrorText, Observer: cfg.Observer, Logger: cfg.Logger,
	})
	if err != nil {
		return nil, err
	}
	fwd, err := middleware.NewPoisonForwarder(middleware.PoisonForwarderConfig{
		Publisher: cfg.PoisonPublisher, Topic: cfg.PoisonTopic, QueueName: queueName,
		ErrorText: cfg.ErrorText, Observer: cfg.Observer, Logger: cfg.Logger,
	})
	if err != nil {
		return nil, err
	}
	guard, err := middleware.NewRedeliveryGuard(middleware.RedeliveryGuardConfig{
		Delayer: cfg.Delayer, MaxRedeliveries: cfg.MaxRedeliveries, QueueName: queueName, Logger: cfg.Logger,
		RedeliveriesCounted: cfg.RedeliveriesCounted,
	})
	if err != nil {
		return nil, err
	}
	fb := &fallback{
		delayer: cfg.Delayer, maxAttempts: rep.MaxAttempts(), pause: cfg.FallbackPause,
		errorText: cfg.ErrorText, queueName: queueName, logger: cfg.Logger,
	}
	if fb.pause == 0 {
		fb.pause = defaultFallbackPause
	}
	if fb.errorText == nil {
		fb.errorText = func(err error) string { return retrymeta.ErrorText(err, retrymeta.DefaultMaxErrorBytes) }
	}
	if fb.logger == nil {
		fb.logger = watermill.NopLogger{}
	}
	var pause *middleware.Pause
	if cfg.Pause != nil {
		if pause, err = newPause(*cfg.Pause, cfg, classifier); err != nil {
			return nil, err
		}
	}
	return &Chain{Counter: counter, Forwarder: fwd, Guard: guard, Republisher: rep, Classifier: classifier, Pause: pause, Tracing: tracing, fallback: fb}, nil
}

// newTracing returns the Tracing middleware of c.Tracing (nil: none), its
// MaxAttempts and QueueName defaulted to c's, and adds its span events to
// c.Observer.
func (c *Config) newTracing(queueName func(ctx context.Context) string) *middleware.Tracing {
	if c.Tracing == nil {
		return nil
	}
	tc := *c.Tracing
	if tc.MaxAttempts == 0 {
		tc.MaxAttempts = c.MaxAttempts // defaulted
	}
	if tc.QueueName == nil {
		tc.QueueName = queueName
	}
	tracing := middleware.NewTracing(tc)
	if c.Observer != nil {
		c.Observer = middleware.Observers(c.Observer, tracing.Observer())
	} else {
		c.Observer = tracing.Observer()
	}
	return tracing
}

func newPause(pc middleware.PauseConfig, cfg Config, classifier *middleware.Classifier) (*middleware.Pause, error) {
	if pc.Delayer == nil {
		pc.Delayer = cfg.Delayer
	}
	if pc.Counts == nil {
		pc.Counts = func(err error) bool { return classifier.Classify(err).Action == middleware.ActionRetry }
	}
	if pc.Logger == nil {
		pc.Logger = cfg.Logger
	}
	if po, ok := cfg.Observer.(middleware.PauseObserver); ok && pc.Observer == nil {
		pc.Observer = po
	}
	return middleware.NewPause(pc)
}

// Middleware runs h inside the whole chain; use it with
// (*message.Router).AddMiddleware or (*message.Handler).AddMiddleware.
func (c *Chain) Middleware(h message.HandlerFunc) message.HandlerFunc {
	if c.Pause != nil {
		h = c.Pause.Middleware(h)
	}
	h = c.Counter.Middleware(c.fallback.Middleware(c.Forwarder.Middleware(c.Guard.Middleware(c.Republisher.Middleware(c.Classifier.Middleware(h))))))
	if c.Tracing != nil {
		h = c.Tracing.Middleware(h)
	}
	return h
}

// AddTo adds the chain to r, followed by extra middlewares (which end up
// inside the chain, nearer the handler: put middleware.Recoverer and
// middleware.Timeout here so that panics and deadlines are classified like
// errors).
func (c *Chain) AddTo(r *message.Router, inner ...message.HandlerMiddleware) {
	r.AddMiddleware(c.Middleware)
	r.AddMiddleware(inner...)
}
