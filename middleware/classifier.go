package middleware

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
)

// Action is what the retry chain does with a failed message.
type Action int

const (
	// ActionRetry schedules the message for another attempt after a delay,
	// while attempts are left; after the last attempt it goes to the poison
	// queue.
	ActionRetry Action = iota
	// ActionPoison sends the message to the poison queue at once: retrying
	// cannot help (malformed input, a permanent refusal).
	ActionPoison
	// ActionDrop acks and discards the message, logged at Info level. Use it
	// for messages that are obsolete, never for ones that matter.
	ActionDrop
	// ActionNack returns the message to the broker untouched: nothing is
	// published and nothing is acked. The Classifier gives it (class
	// ClassInterrupted) to a failure that happened after the subscriber had
	// already given the delivery back (its context was done: router shutdown,
	// or watermill-amqp's consumer loop stopping), so that no retry copy and no
	// poison copy is made for a delivery the broker will redeliver anyway. It
	// is not accepted in rules.
	ActionNack
)

// String returns "retry", "poison", "drop" or "nack".
func (a Action) String() string {
	switch a {
	case ActionRetry:
		return "retry"
	case ActionPoison:
		return "poison"
	case ActionDrop:
		return "drop"
	case ActionNack:
		return "nack"
	default:
		return fmt.Sprintf("Action(%d)", int(a))
	}
}

// Error classes written under ErrorClassKey and used as metric labels.
const (
	ClassTransient  = "transient"
	ClassPermanent  = "permanent"
	ClassMalformed  = "malformed"
	ClassRetryAfter = "retry-after"
	ClassDropped    = "dropped"
	ClassExhausted  = "exhausted"
	// ClassUndelayable: the Delayer refused the copy with ErrCannotDelay.
	ClassUndelayable = "undelayable"
	// ClassInterrupted: the handler failed after its delivery had already
	// been given back to the broker (ActionNack); never poisoned.
	ClassInterrupted = "interrupted"
	// ClassRedeliveryLimit: the message came back redelivered more than
	// RedeliveryGuardConfig.MaxRedeliveries times (it keeps killing or
	// stalling its consumer); poisoned without running the handler again.
	ClassRedeliveryLimit = "redelivery-limit"
)

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying: the default classifier sends it
// to the poison queue at once. Permanent(nil) returns nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// isPermanent reports whether err, or an error it wraps, was marked with
// Permanent.
func isPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

type dropError struct{ err error }

func (e *dropError) Error() string { return e.err.Error() }
func (e *dropError) Unwrap() error { return e.err }

// Drop marks err so that the message is acked and discarded (logged), neither
// retried nor poisoned. Drop(nil) returns nil.
func Drop(err error) error {
	if err == nil {
		return nil
	}
	return &dropError{err: err}
}

// isDrop reports whether err, or an error it wraps, was marked with Drop.
func isDrop(err error) bool {
	var d *dropError
	return errors.As(err, &d)
}

// RetryAfter wraps err with a handler-chosen delay d (time.Duration, must be
// > 0; a delay <= 0 means "use the backoff policy"). The republisher uses
// max(d, backoff delay); the AMQP delayer then rounds up to a delay tier.
// RetryAfter(nil, d) returns nil. The Classifier reports the delay asked
// in Classification.Delay (DefaultClassifier.Classify(err).Delay).
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &chainerr.RetryAfterError{Err: err, After: d}
}

// Rule is one classification rule: when Match returns true for a handler
// error, the message gets Action, and Class is recorded under ErrorClassKey.
type Rule struct {
	// Class names the rule's outcome, e.g. "malformed". Required.
	Class string
	// Match reports whether the rule applies. Required.
	Match func(error) bool
	// Action is what happens to the message.
	Action Action
}

// MatchIs returns a matcher for errors.Is(err, target).
func MatchIs(target error) func(error) bool {
	return func(err error) bool { return errors.Is(err, target) }
}

// MatchAs returns a matcher for errors.As(err, *T).
func MatchAs[T error]() func(error) bool {
	return func(err error) bool {
		var t T
		return errors.As(err, &t)
	}
}

// DefaultRules are evaluated in this order, the first match wins:
//   - Drop(err) -> ActionDrop, class "dropped";
//   - Permanent(err) -> ActionPoison, class "permanent";
//   - RetryAfter(err, d) -> ActionRetry with delay d, class "retry-after";
//   - *json.SyntaxError, *json.UnmarshalTypeError, *json.InvalidUnmarshalError
//     -> ActionPoison, class "malformed" (a malformed message does not get
//     better by waiting).
//
// Anything else falls to Classifier.Default (ActionRetry, class "transient"),
// which includes context.Canceled and context.DeadlineExceeded: a handler
// interrupted by shutdown or a timeout is retried, never poisoned.
func DefaultRules() []Rule {
	return []Rule{
		{Class: ClassDropped, Match: isDrop, Action: ActionDrop},
		{Class: ClassPermanent, Match: isPermanent, Action: ActionPoison},
		{Class: ClassRetryAfter, Match: func(err error) bool { _, ok := chainerr.RetryAfter(err); return ok }, Action: ActionRetry},
		{Class: ClassMalformed, Match: MatchAs[*json.SyntaxError](), Action: ActionPoison},
		{Class: ClassMalformed, Match: MatchAs[*json.UnmarshalTypeError](), Action: ActionPoison},
		{Class: ClassMalformed, Match: MatchAs[*json.InvalidUnmarshalError](), Action: ActionPoison},
	}
}

// Classification is the verdict on one handler error.
type Classification struct {
	Action Action
	// Class is the error class, e.g. "transient" or "malformed".
	Class string
	// Delay is a handler-requested delay (RetryAfter); 0 means "use backoff".
	Delay time.Duration
}

// classifiedError carries a handler error with its Classification through
// the middleware chain. The republisher and the poison forwarder read it with
// errors.As; an error without it is classified with DefaultClassifier. It
// is not public API: Classifier.Classify reads it back, and the router's
// fallback and the audit read it through chainerr.Classified.
type classifiedError struct {
	Err error
	Classification
}

// Error returns the handler error's text unchanged.
func (e *classifiedError) Error() string { return e.Err.Error() }

// Unwrap returns the handler error.
func (e *classifiedError) Unwrap() error { return e.Err }

// ClassifierConfig configures a Classifier.
type ClassifierConfig struct {
	// Rules are checked before DefaultRules, first match wins.
	Rules []Rule
	// NoDefaultRules drops DefaultRules; only Rules then apply.
	NoDefaultRules bool
	// DeliveryAlive reports whether msg's delivery can still be acked. A
	// failure on a delivery that cannot (its AMQP channel closed, its consumer
	// cancelled) is classified ActionNack / ClassInterrupted: the broker has
	// already returned the message, so a retry or poison copy would fork it.
	// Default: always true (amqpretry.New sets one for AMQP).
	DeliveryAlive func(msg *message.Message) bool
	// Default is the action for an error no rule matches. Default ActionRetry.
	Default Action
	// DefaultClass is the class for such an error. Default "transient".
	DefaultClass string
	// Logger logs dropped messages. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// Observer is told of each dropped message (Observer.Dropped). Default
	// NopObserver.
	Observer Observer
}

func (c *ClassifierConfig) setDefaults() {
	if c.DefaultClass == "" {
		c.DefaultClass = ClassTransient
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.Observer == nil {
		c.Observer = NopObserver{}
	}
}

// Validate reports the first bad field: a rule without Class or Match, or an
// unknown Default action.
func (c ClassifierConfig) Validate() error {
	for i, r := range c.Rules {
		if r.Match == nil {
			return fmt.Errorf("ClassifierConfig.Rules[%d].Match is nil", i)
		}
		if r.Class == "" {
			return fmt.Errorf("ClassifierConfig.Rules[%d].Class is empty", i)
		}
		if r.Action < ActionRetry || r.Action > ActionDrop {
			return fmt.Errorf("ClassifierConfig.Rules[%d].Action %d is not a known Action", i, int(r.Action))
		}
	}
	if c.Default < ActionRetry || c.Default > ActionDrop {
		return fmt.Errorf("ClassifierConfig.Default %d is not a known Action", int(c.Default))
	}
	return nil
}

// Classifier decides, for each handler error, whether to retry, poison or
// drop. As a middleware it wraps the handler's error with its
// Classification (Classify reads it back) and handles ActionDrop itself (ack, log); retry and poison are done by the
// republisher and the poison forwarder further out in the chain.
type Classifier struct {
	rules        []Rule
	def          Action
	defaultClass string
	logger       watermill.LoggerAdapter
	observer     Observer
	alive        func(msg *message.Message) bool
}

// NewClassifier returns a Classifier, or the error of cfg.Validate.
func NewClassifier(cfg ClassifierConfig) (*Classifier, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rules := append([]Rule(nil), cfg.Rules...)
	if !cfg.NoDefaultRules {
		rules = append(rules, DefaultRules()...)
	}
	alive := cfg.DeliveryAlive
	if alive == nil {
		alive = func(*message.Message) bool { return true }
	}
	return &Classifier{rules: rules, def: cfg.Default, defaultClass: cfg.DefaultClass, logger: cfg.Logger, observer: cfg.Observer,
		alive: alive}, nil
}

// DefaultClassifier uses DefaultRules and retries everything else.
var DefaultClassifier = func() *Classifier {
	c, err := NewClassifier(ClassifierConfig{})
	if err != nil {
		panic(err) // static configuration; cannot fail
	}
	return c
}()

// Classify returns the verdict for err (err must be non-nil). An error that
// already carries a classification (the chain's own wrapping) keeps it.
func (c *Classifier) Classify(err error) Classification {
	var ce *classifiedError
	if errors.As(err, &ce) {
		return ce.Classification
	}
	for _, r := range c.rules {
		if r.Match(err) {
			cl := Classification{Action: r.Action, Class: r.Class}
			if d, ok := chainerr.RetryAfter(err); ok && r.Action == ActionRetry {
				cl.Delay = d
			}
			return cl
		}
	}
	cl := Classification{Action: c.def, Class: c.defaultClass}
	if d, ok := chainerr.RetryAfter(err); ok && c.def == ActionRetry {
		cl.Delay = d
	}
	return cl
}

// classify wraps err with its classification (idempotent).
func (c *Classifier) classify(err error) *classifiedError {
	var ce *classifiedError
	if errors.As(err, &ce) {
		return ce
	}
	return &classifiedError{Err: err, Classification: c.Classify(err)}
}

// Middleware classifies the handler's error. ActionDrop: the message is
// acked (nil error, no produced messages) and the drop is logged.
// Otherwise the error is returned wrapped with its Classification (which
// Classify, of any Classifier, returns for it).
//
// A failure returned when the message's context (as it entered this
// middleware, i.e. the subscriber's, not one a Timeout middleware further in
// derived) is already done is classified ActionNack / ClassInterrupted
// whatever the error: the subscriber has given the delivery back (on router
// shutdown watermill-amqp nacks in-flight deliveries while their handlers
// still run), so acting on the failure would poison or copy a message the
// broker redelivers anyway. The same holds when DeliveryAlive reports the
// delivery can no longer be acked.
func (c *Classifier) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		// The success path's frame is under the handler's, on a fresh
		// goroutine per message: keep it small (only ctx lives across h).
		ctx := msg.Context()
		out, err := h(msg)
		if err == nil {
			return out, nil
		}
		if err = c.onFailure(ctx, msg, err); err == nil {
			return nil, nil // dropped
		}
		return out, err
	}
}

// onFailure is kept out of line so that the success path's closure stays
// small (see Republisher.onFailure). ctx is the message's context before
// the handler ran: a failure after it ended, or after the delivery was
// lost, is an interruption, not the handler's verdict.
//
//go:noinline
func (c *Classifier) onFailure(ctx context.Context, msg *message.Message, err error) error {
	if ctx.Err() != nil || !c.alive(msg) {
		return &classifiedError{Err: err, Classification: Classification{Action: ActionNack, Class: ClassInterrupted}}
	}
	ce := c.classify(err)
	if ce.Action == ActionDrop {
		attempt := Attempt(msg)
		c.logger.Info("Dropping message on handler request", watermill.LogFields{
			"message_uuid": msg.UUID, "error": err.Error(), "attempt": attempt,
		})
		c.observer.Dropped(msg, attempt)
		return nil
	}
	return ce
}

// classificationOf returns the classification carried by err, or the
// DefaultClassifier's verdict for an unclassified error.
func classificationOf(err error) Classification {
	var ce *classifiedError
	if errors.As(err, &ce) {
		return ce.Classification
	}
	return DefaultClassifier.Classify(err)
}
