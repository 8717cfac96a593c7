package middleware

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// PoisonForwarderConfig configures a PoisonForwarder.
type PoisonForwarderConfig struct {
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
	// queue. Default: an exhausted retry (past MaxAttempts), or an error classified
	// ActionPoison (errors not passed through the Classifier are
	// classified with DefaultClassifier). Errors it rejects are
	// returned unchanged (the message is nacked).
	ShouldPoison func(err error) bool
	// ErrorText renders the error into reason_poisoned and LastErrorKey.
	// Default: the error text cut to 1 KiB on a UTF-8 boundary.
	// Error texts can carry secrets: redact them here.
	ErrorText func(error) string
	// Now returns the current time. Default time.Now.
	Now func() time.Time
	// Observer is told of each poisoned message and failed poison publish.
	// Default NopObserver.
	Observer Observer
	// Logger logs each poisoned message at Info. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *PoisonForwarderConfig) setDefaults() {
	if c.Topic == nil {
		c.Topic = func(context.Context) string { return "poison" }
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.ShouldPoison == nil {
		c.ShouldPoison = defaultShouldPoison
	}
	if c.ErrorText == nil {
		c.ErrorText = func(err error) string { return retrymeta.ErrorText(err, retrymeta.DefaultMaxErrorBytes) }
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Observer == nil {
		c.Observer = NopObserver{}
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field.
func (c PoisonForwarderConfig) Validate() error {
	if c.Publisher == nil {
		return errors.New("middleware.PoisonForwarderConfig.Publisher is nil")
	}
	return nil
}

// defaultShouldPoison poisons exhausted retries and errors classified
// ActionPoison. A *chainerr.ScheduleError (the retry could not be
// scheduled) and a *chainerr.DeadLetterRetryError (the broker takes the
// retry) are never poisoned: those messages stay retriable.
func defaultShouldPoison(err error) bool {
	var se *chainerr.ScheduleError
	var dl *chainerr.DeadLetterRetryError
	if errors.As(err, &se) || errors.As(err, &dl) {
		return false
	}
	var ex *chainerr.ExhaustedError
	if errors.As(err, &ex) {
		return true
	}
	var ce *classifiedError
	if errors.As(err, &ce) {
		return ce.Action == ActionPoison
	}
	return DefaultClassifier.Classify(err).Action == ActionPoison
}

// PoisonForwarder is the poison-queue
type PoisonForwarder struct {
	cfg PoisonForwarderConfig
}

// NewPoisonForwarder returns a PoisonForwarder, or the error of cfg.Validate.
func NewPoisonForwarder(cfg PoisonForwarderConfig) (*PoisonForwarder, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &PoisonForwarder{cfg: cfg}, nil
}

// Middleware forwards messages whose handler error passes ShouldPoison to the
// poison topic, with failure metadata, and acks the original only after the
// publish returned nil. If the publish fails, it returns an error wrapping the
// publisher's and the message is nacked (the router's fallback then sends it
// back to its queue).
func (f *PoisonForwarder) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		return f.onFailure(msg, out, err)
	}
}

// onFailure is kept out of line so that the success path's closure stays
// small (see Republisher).
//
//go:noinline
func (f *PoisonForwarder) onFailure(msg *message.Message, out []*message.Message, err error) ([]*message.Message, error) {
	if !f.cfg.ShouldPoison(err) {
		return out, err
	}
	ctx := msg.Context()
	attempt := Attempt(msg)
	class := errorClass(err)
	p := f.poisonCopy(ctx, msg, err, attempt, class)
	topic := f.cfg.Topic(ctx)
	if perr := f.cfg.Publisher.Publish(topic, p); perr != nil {
		f.cfg.Observer.PoisonFailed(msg, attempt, perr)
		f.cfg.Logger.Error("Poison publish failed; nacking message", perr, watermill.LogFields{
			"message_uuid": msg.UUID, "poison_topic": topic, "attempt": attempt,
		})
		return nil, &chainerr.PoisonError{Err: perr, HandlerErr: err}
	}
	// The poison copy is confirmed: only now may the original be acked.
	f.cfg.Observer.Poisoned(msg, attempt, class)
	f.cfg.Logger.Info("Message poisoned", watermill.LogFields{
		"message_uuid": msg.UUID, "poison_topic": topic, "attempt": attempt,
		"error_class": class, "error": p.Metadata[retrymeta.PoisonReasonKey],
	})
	return nil, nil
}

// errorClass returns the class a failure is poisoned with (ErrorClassKey): the class of a
// classified error whose action is ActionPoison, else
// ClassExhausted for a *chainerr.ExhaustedError, else the
// error's classification.
func errorClass(err error) string {
	var ce *classifiedError
	if errors.As(err, &ce) && ce.Action == ActionPoison {
		return ce.Class
	}
	var ex *chainerr.ExhaustedError
	if errors.As(err, &ex) {
		return ClassExhausted
	}
	if ce != nil {
		return ce.Class
	}
	return DefaultClassifier.Classify(err).Class
}

func (f *PoisonForwarder) poisonCopy(ctx context.Context, msg *message.Message, err error, attempt int, class string) *message.Message {
	p := retrymeta.CloneMessage(msg)
	now := f.cfg.Now()
	text := f.cfg.ErrorText(err)
	retrymeta.RecordFailure(p.Metadata, now, text, class, f.cfg.QueueName(ctx))
	retrymeta.StripDeliveryMetadata(p.Metadata)
	// One attempt count on a poison copy: PoisonAttemptsKey. The delivery's
	// own attempt numbers would only repeat it (or, proven, contradict it).
	delete(p.Metadata, AttemptKey)
	delete(p.Metadata, retrymeta.ProvenAttemptKey)
	p.Metadata.Set(retrymeta.PoisonReasonKey, text)
	p.Metadata.Set(retrymeta.PoisonTopicKey, message.SubscribeTopicFromCtx(ctx))
	p.Metadata.Set(retrymeta.PoisonHandlerKey, message.HandlerNameFromCtx(ctx))
	p.Metadata.Set(retrymeta.PoisonSubscriberKey, message.SubscriberNameFromCtx(ctx))
	p.Metadata.Set(PoisonAttemptsKey, strconv.Itoa(attempt))
	p.Metadata.Set(PoisonedAtKey, now.UTC().Format(time.RFC3339Nano))
	return p
}

func init() {
	// The router's fallback records the poison class, and reads a carried
	// classification, through package chainerr: they are not public API.
	chainerr.ErrorClass = errorClass
	chainerr.Classified = classified
}

// classified returns the action and class carried by err (see
// chainerr.Classified).
func classified(err error) (action int, class string, ok bool) {
	var ce *classifiedError
	if !errors.As(err, &ce) {
		return 0, "", false
	}
	return int(ce.Action), ce.Class, true
}
