// Package router assembles the retry middlewares in the one correct order and
// plugs them into a Watermill *message.Router.
//
// From the outside in:
//
//	AttemptCounter       sets the attempt number before anything reads it
//	  fallback             settles what nothing further in could: pause, copy back
//	                       to the origin queue (confirmed), else nack with requeue
//	    poison.Forwarder     poisons permanent and exhausted failures (confirmed, then ack)
//	      RedeliveryGuard      a redelivered message is not run: a counted copy is
//	                           requeued, or moved to the quarantine queue (confirmed,
//	                           then ack); at the limit, poisoned
//	        Republisher          past MaxAttempts: poisoned without running; otherwise
//	                             schedules retries through the Delayer (confirmed, then ack)
//	          Classifier           wraps the handler error with retry / poison / drop,
//	                               or nack when the delivery was already given back
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
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/poison"
)

// Config configures the retry chain. Zero values take the defaults of the
// middleware they belong to.
type Config struct {
	// Delayer holds retry copies (amqpretry's wait queues, or
	// middleware.MemoryDelayer for gochannel). Required.
	Delayer middleware.Delayer
	// PoisonPublisher receives poisoned messages; Publish must return only
	// once the message is durably stored. Required.
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
	// library's attempt header plus x-death rejections from QueueName.
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
	// Delayer is a middleware.Quarantiner; see middleware.RedeliveryGuard).
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
	// no pause (tests).
	FallbackPause time.Duration
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
	return nil
}

// Chain is the assembled retry chain.
type Chain struct {
	Counter     *middleware.AttemptCounter
	Forwarder   *poison.Forwarder
	Guard       *middleware.RedeliveryGuard
	Republisher *middleware.Republisher
	Classifier  *middleware.Classifier
	fallback    *fallback
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
	sources := cfg.AttemptSources
	if len(sources) == 0 {
		sources = []middleware.AttemptSource{
			middleware.HeaderSource(),
			middleware.XDeathSource(func(msg *message.Message) string { return queueName(msg.Context()) }),
		}
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
	fwd, err := poison.NewForwarder(poison.ForwarderConfig{
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
		fb.errorText = func(err error) string { return middleware.ErrorText(err, middleware.DefaultMaxErrorBytes) }
	}
	if fb.logger == nil {
		fb.logger = watermill.NopLogger{}
	}
	return &Chain{Counter: counter, Forwarder: fwd, Guard: guard, Republisher: rep, Classifier: classifier, fallback: fb}, nil
}

// Middleware runs h inside the whole chain; use it with
// (*message.Router).AddMiddleware or (*message.Handler).AddMiddleware.
func (c *Chain) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return c.Counter.Middleware(c.fallback.Middleware(c.Forwarder.Middleware(c.Guard.Middleware(c.Republisher.Middleware(c.Classifier.Middleware(h))))))
}

// AddTo adds the chain to r, followed by extra middlewares (which end up
// inside the chain, nearer the handler: put middleware.Recoverer and
// middleware.Timeout here so that panics and deadlines are classified like
// errors).
func (c *Chain) AddTo(r *message.Router, inner ...message.HandlerMiddleware) {
	r.AddMiddleware(c.Middleware)
	r.AddMiddleware(inner...)
}
