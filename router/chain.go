// Package router assembles the retry middlewares in the one correct order and
// plugs them into a Watermill *message.Router.
//
// From the outside in:
//
//	[Tracing]            optional: one OpenTelemetry span per attempt
//	AttemptCounter       sets the attempt number before anything reads it
//	  fallback             settles what nothing further in could: pause, copy back
//	                       to the origin queue (confirmed), else nack with requeue
//	    PoisonForwarder      poisons permanent and exhausted failures (confirmed, then ack)
//	      RedeliveryGuard      a delivery back before its whole delay is held again;
//	                           a redelivered message is not run: a counted copy is
//	                           requeued, or moved to the quarantine queue (confirmed,
//	                           then ack); at the limit, poisoned
//	        Republisher          past MaxAttempts: poisoned without running; otherwise
//	                             schedules retries through the Delayer (confirmed, then ack)
//	          Classifier           wraps the handler error with retry / poison / drop,
//	                               or nack when the delivery was already given back
//	            [Pause]              optional: holds messages, uncharged, while a
//	                                 dependency is down; probes, then resumes
//	            [Recoverer, Timeout, ...]  Watermill middlewares that turn panics and
//	                                       deadlines into errors go inside the chain
//	              handler
//
// The counter is outermost so every inner layer sees the same attempt. The
// classifier is innermost so every layer acts on its verdict. The forwarder
// wraps the guard and the republisher because both turn "no more tries" into
// an error it poisons. The fallback wraps the forwarder because a failed
// poison publish is one of the two failures it settles (the other is a
// retry the Delayer could not hold).
//
// Every message that enters the chain ends exactly one way: acked after
// success (or a Drop); acked after its retry copy was held by the Delayer
// (for AMQP: confirmed by the broker); acked after its poison copy was
// confirmed; or, when no copy could be held, nacked with requeue after a
// pause, so it stays in its queue. Nothing is acked before the copy that
// replaces it is confirmed.
package router

import (
	"context"
	"errors"
	"reflect"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/cenkalti/backoff/v4"

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
	// MaxAttempts is the total number of attempts including the first.
	// Default 5; range [1, middleware.MaxAttemptsCap].
	MaxAttempts int
	// Backoff makes a fresh backoff policy. Default middleware.DefaultBackoff
	// (exponential from 1 s, factor 2, ±50% jitter, 5 min cap).
	Backoff func() backoff.BackOff
	// Classifier configures error classification. Default: DefaultRules,
	// everything else transient.
	Classifier middleware.ClassifierConfig
	// AttemptSources are summed into the attempt number. Default: the
	// attempt header of the library's own copies for QueueName
	// (middleware.HeaderSource), x-death rejections from QueueName on
	// deliveries back through a retry route (middleware.XDeathSource), and
	// the broker's count of returns: middleware.NackCountSource, or
	// middleware.AcquiredCountSource with RedeliveriesCounted. Counts a
	// producer or another queue's chain wrote never count. NackCountSource
	// is unproven (middleware.AttemptSource.Proven): a message past
	// MaxAttempts only by its nacks runs once more as the last attempt
	// instead of being poisoned without running.
	AttemptSources []middleware.AttemptSource
	// QueueName names the originating queue of a message. Default: the
	// router's subscribe topic.
	QueueName func(ctx context.Context) string
	// ErrorText renders errors into headers; use it to redact secrets.
	// Default: err.Error() cut to 1 KiB.
	ErrorText func(error) string
	// MaxRedeliveries bounds the broker redeliveries (crashes, consumer
	// timeouts, returns) a message may cause: the one that brings its count
	// to MaxRedeliveries poisons it with class
	// middleware.ClassRedeliveryLimit (attributable ones only when the
	// Delayer can quarantine: amqpretry's, with Retry.NewSubscriber; see middleware.RedeliveryGuard).
	// Default middleware.DefaultMaxRedeliveries.
	MaxRedeliveries int
	// RedeliveriesCounted: AttemptSources count every broker redelivery as
	// an attempt (middleware.AcquiredCountSource), so the RedeliveryGuard
	// lets redelivered messages run (see
	// middleware.RedeliveryGuardConfig.RedeliveriesCounted) and
	// MaxRedeliveries is not used. Default false.
	RedeliveriesCounted bool
	// FallbackPause is how long a message whose retry or poison copy was not
	// held waits before the fallback copy (or the requeue), so a refusing
	// broker is not hammered. Default DefaultFallbackPause (1 s); negative:
	// no pause (tests). A failed retry whose handler asked for a longer
	// delay (middleware.RetryAfter) waits that delay instead, up to one
	// minute (the delivery stays unacked meanwhile): the fallback copy goes
	// straight back to the queue, so the next attempt never runs earlier
	// than asked. A longer RetryAfter is handed to the Delayer once more
	// after the pause; if that fails too, the copy goes back to the queue
	// carrying the remaining delay (header rabbitretry-remaining-delay-ms), and the
	// RedeliveryGuard holds it again before it runs.
	FallbackPause time.Duration
	// Pause, when set, pauses consumption while a dependency is down instead
	// of charging attempts (see middleware.Pause): it goes just inside the
	// Classifier. Its Delayer defaults to Config.Delayer, its Counts to "the
	// Classifier would retry it", its Logger to Config.Logger, and its
	// Observer to Config.Observer when that implements
	// middleware.PauseObserver (metrics.Metrics does). Default nil (off).
	Pause *middleware.PauseConfig
	// Tracing, when set, makes an OpenTelemetry span per attempt and keeps
	// all attempts of a message in one trace (see middleware.Tracing): it
	// goes outermost, and its span events are added to Observer. Its
	// MaxAttempts and QueueName default to this Config's. Default nil (off).
	Tracing *middleware.TracingConfig
	// Observer is told of retries, poisonings and drops (e.g. metrics).
	Observer middleware.Observer
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
	queueName := cfg.QueueName
	if queueName == nil {
		queueName = message.SubscribeTopicFromCtx
	}
	var tracing *middleware.Tracing
	if cfg.Tracing != nil {
		tc := *cfg.Tracing
		if tc.MaxAttempts == 0 {
			tc.MaxAttempts = cfg.MaxAttempts
			if tc.MaxAttempts == 0 {
				tc.MaxAttempts = middleware.DefaultMaxAttempts
			}
		}
		if tc.QueueName == nil {
			tc.QueueName = queueName
		}
		tracing = middleware.NewTracing(tc)
		if cfg.Observer != nil {
			cfg.Observer = middleware.Observers(cfg.Observer, tracing.Observer())
		} else {
			cfg.Observer = tracing.Observer()
		}
	}
	sources := cfg.AttemptSources
	if len(sources) == 0 {
		// One counting rule for every retry mode: this queue's own evidence
		// (its chain's attempt header, its own x-death entries, the returns
		// the broker counted), so a deploy that switches modes keeps the
		// count.
		returns := middleware.NackCountSource()
		if cfg.RedeliveriesCounted {
			returns = middleware.AcquiredCountSource()
		}
		qn := func(msg *message.Message) string { return queueName(msg.Context()) }
		sources = []middleware.AttemptSource{middleware.HeaderSource(qn), middleware.XDeathSource(qn), returns}
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
		fb.pause = DefaultFallbackPause
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
