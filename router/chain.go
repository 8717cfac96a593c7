// Package router assembles the retry middlewares in the one correct order and
// plugs them into a Watermill *message.Router.
//
// From the outside in:
//
//	AttemptCounter     sets the attempt number before anything reads it
//	  poison.Forwarder   poisons permanent and exhausted failures (confirmed, then ack)
//	    Republisher        schedules retries through the Delayer (confirmed, then ack)
//	      Classifier         wraps the handler error with retry / poison / drop
//	        [Recoverer, Timeout, ...]  Watermill middlewares that turn panics and
//	                                   deadlines into errors go inside the chain
//	          handler
//
// The counter is outermost so every inner layer sees the same attempt. The
// classifier is innermost so both the republisher and the forwarder act on
// its verdict. The forwarder wraps the republisher because the republisher
// turns "retryable but out of attempts" into a *middleware.ExhaustedError
// that the forwarder poisons; and a failed retry schedule (ScheduleError) or
// failed poison publish (PoisonError) passes through both and nacks the
// message, never acks it.
package router

import (
	"context"
	"errors"

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
	Republisher *middleware.Republisher
	Classifier  *middleware.Classifier
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
	return &Chain{Counter: counter, Forwarder: fwd, Republisher: rep, Classifier: classifier}, nil
}

// Middleware runs h inside the whole chain; use it with
// (*message.Router).AddMiddleware or (*message.Handler).AddMiddleware.
func (c *Chain) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return c.Counter.Middleware(c.Forwarder.Middleware(c.Republisher.Middleware(c.Classifier.Middleware(h))))
}

// AddTo adds the chain to r, followed by extra middlewares (which end up
// inside the chain, nearer the handler: put middleware.Recoverer and
// middleware.Timeout here so that panics and deadlines are classified like
// errors).
func (c *Chain) AddTo(r *message.Router, inner ...message.HandlerMiddleware) {
	r.AddMiddleware(c.Middleware)
	r.AddMiddleware(inner...)
}
