// Package poison forwards messages that cannot be processed to a poison
// queue with their failure metadata, and provides the tools to inspect,
// replay and purge such a queue.
package poison

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// Metadata keys set on a poisoned message. The first four are Watermill's
// own (message/router/middleware.PoisonQueue), so tools built for Watermill's
// poison queue read ours too.
const (
	ReasonKey     = wmw.ReasonForPoisonedKey  // "reason_poisoned": the (truncated) error text
	TopicKey      = wmw.PoisonedTopicKey      // "topic_poisoned": the subscribe topic
	HandlerKey    = wmw.PoisonedHandlerKey    // "handler_poisoned"
	SubscriberKey = wmw.PoisonedSubscriberKey // "subscriber_poisoned"
	// AttemptsKey holds how many attempts were made (decimal).
	//
	// Deprecated: use middleware.PoisonAttemptsKey (the same key).
	AttemptsKey = middleware.PoisonAttemptsKey
	// PoisonedAtKey holds the RFC 3339 time the message was poisoned.
	//
	// Deprecated: use middleware.PoisonedAtKey (the same key).
	PoisonedAtKey = middleware.PoisonedAtKey
)

// ForwarderConfig configures a Forwarder.
type ForwarderConfig struct {
	// Publisher receives poisoned messages. Its Publish must return only
	// after the message is durably stored (amqpretry's publisher waits for
	// publisher confirms); the original is acked only after that. Required.
	Publisher message.Publisher
	// Topic returns the poison topic for a failed message, given the
	// original message's context. Default: the constant "poison".
	Topic func(ctx context.Context) string
	// QueueName names the originating queue (OriginalQueueKey). Default: the
	// router's subscribe topic.
	QueueName func(ctx context.Context) string
	// ShouldPoison decides whether a handler error goes to the poison
	// queue. Default: a *middleware.ExhaustedError, or an error classified
	// middleware.ActionPoison (errors not passed through the Classifier are
	// classified with middleware.DefaultClassifier). Errors it rejects are
	// returned unchanged (the message is nacked).
	ShouldPoison func(err error) bool
	// ErrorText renders the error into reason_poisoned and LastErrorKey.
	// Default middleware.ErrorText(err, middleware.DefaultMaxErrorBytes).
	// Error texts can carry secrets: redact them here.
	ErrorText func(error) string
	// Now returns the current time. Default time.Now.
	Now func() time.Time
	// Observer is told of each poisoned message and failed poison publish.
	// Default middleware.NopObserver.
	Observer middleware.Observer
	// Logger logs each poisoned message at Info. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *ForwarderConfig) setDefaults() {
	if c.Topic == nil {
		c.Topic = func(context.Context) string { return "poison" }
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.ShouldPoison == nil {
		c.ShouldPoison = DefaultShouldPoison
	}
	if c.ErrorText == nil {
		c.ErrorText = func(err error) string { return middleware.ErrorText(err, middleware.DefaultMaxErrorBytes) }
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Observer == nil {
		c.Observer = middleware.NopObserver{}
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field.
func (c ForwarderConfig) Validate() error {
	if c.Publisher == nil {
		return errors.New("poison.ForwarderConfig.Publisher is nil")
	}
	return nil
}

// DefaultShouldPoison poisons exhausted retries and errors classified
// ActionPoison. A *middleware.ScheduleError (the retry could not be
// scheduled) and a *middleware.DeadLetterRetryError (the broker takes the
// retry) are never poisoned: those messages stay retriable.
func DefaultShouldPoison(err error) bool {
	var se *middleware.ScheduleError
	var dl *middleware.DeadLetterRetryError
	if errors.As(err, &se) || errors.As(err, &dl) {
		return false
	}
	var ex *middleware.ExhaustedError
	if errors.As(err, &ex) {
		return true
	}
	var ce *middleware.ClassifiedError
	if errors.As(err, &ce) {
		return ce.Action == middleware.ActionPoison
	}
	return middleware.DefaultClassifier.Classify(err).Action == middleware.ActionPoison
}

// Forwarder is the poison-queue middleware.
type Forwarder struct {
	cfg ForwarderConfig
}

// NewForwarder returns a Forwarder, or the error of cfg.Validate.
func NewForwarder(cfg ForwarderConfig) (*Forwarder, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Forwarder{cfg: cfg}, nil
}

// PoisonError is returned when publishing to the poison queue failed; the
// original message is then nacked and stays retriable.
type PoisonError struct {
	Err        error
	HandlerErr error
}

// Error describes both the publish failure and the handler error.
func (e *PoisonError) Error() string {
	return fmt.Sprintf("publishing to the poison queue failed: %v (handler error: %v)", e.Err, e.HandlerErr)
}

// Unwrap returns the publisher's error.
func (e *PoisonError) Unwrap() error { return e.Err }

// Middleware forwards messages whose handler error passes ShouldPoison to the
// poison topic, with failure metadata, and acks the original only after the
// publish returned nil. If the publish fails, it returns a *PoisonError and
// the message is nacked.
func (f *Forwarder) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		return f.onFailure(msg, out, err)
	}
}

// onFailure is kept out of line so that the success path's closure stays
// small (see middleware.Republisher).
//
//go:noinline
func (f *Forwarder) onFailure(msg *message.Message, out []*message.Message, err error) ([]*message.Message, error) {
	if !f.cfg.ShouldPoison(err) {
		return out, err
	}
	ctx := msg.Context()
	attempt := middleware.Attempt(msg)
	class := ErrorClass(err)
	p := f.poisonCopy(ctx, msg, err, attempt, class)
	topic := f.cfg.Topic(ctx)
	if perr := f.cfg.Publisher.Publish(topic, p); perr != nil {
		f.cfg.Observer.PoisonFailed(msg, attempt, perr)
		f.cfg.Logger.Error("Poison publish failed; nacking message", perr, watermill.LogFields{
			"message_uuid": msg.UUID, "poison_topic": topic, "attempt": attempt,
		})
		return nil, &PoisonError{Err: perr, HandlerErr: err}
	}
	// The poison copy is confirmed: only now may the original be acked.
	f.cfg.Observer.Poisoned(msg, attempt, class)
	f.cfg.Logger.Info("Message poisoned", watermill.LogFields{
		"message_uuid": msg.UUID, "poison_topic": topic, "attempt": attempt,
		"error_class": class, "error": p.Metadata[ReasonKey],
	})
	return nil, nil
}

// ErrorClass returns the class a failure is poisoned with: the class of a
// *middleware.ClassifiedError whose action is ActionPoison, else
// middleware.ClassExhausted for a *middleware.ExhaustedError, else the
// error's classification.
func ErrorClass(err error) string {
	var ce *middleware.ClassifiedError
	if errors.As(err, &ce) && ce.Action == middleware.ActionPoison {
		return ce.Class
	}
	var ex *middleware.ExhaustedError
	if errors.As(err, &ex) {
		return middleware.ClassExhausted
	}
	if ce != nil {
		return ce.Class
	}
	return middleware.DefaultClassifier.Classify(err).Class
}

func (f *Forwarder) poisonCopy(ctx context.Context, msg *message.Message, err error, attempt int, class string) *message.Message {
	p := middleware.CloneMessage(msg)
	now := f.cfg.Now()
	text := f.cfg.ErrorText(err)
	middleware.RecordFailure(p.Metadata, now, text, class, f.cfg.QueueName(ctx))
	middleware.StripDeliveryMetadata(p.Metadata)
	p.Metadata.Set(ReasonKey, text)
	p.Metadata.Set(TopicKey, message.SubscribeTopicFromCtx(ctx))
	p.Metadata.Set(HandlerKey, message.HandlerNameFromCtx(ctx))
	p.Metadata.Set(SubscriberKey, message.SubscriberNameFromCtx(ctx))
	p.Metadata.Set(middleware.PoisonAttemptsKey, strconv.Itoa(attempt))
	p.Metadata.Set(middleware.PoisonedAtKey, now.UTC().Format(time.RFC3339Nano))
	return p
}
