// Package chainerr holds the errors the retry chain's middlewares
// (package middleware) return to one another and to the router's fallback
// (package router), and the sentinels amqpretry's own Delayers answer with.
// Users never inspect them: a handler's error reaches the Watermill router
// wrapped in one of them only when the chain nacks the message, and the
// chain itself decides what happens next. They were exported from package
// middleware before; they live here so that middleware, router, amqpretry and
// the library's tests share them without making them public API.
package chainerr

import (
	"errors"
	"fmt"
	"time"
)

// ErrDeadLetter is returned (possibly wrapped) by a Delayer that lets the
// broker hold the retry by dead-lettering the original instead of publishing
// a copy: the republisher then returns a *DeadLetterRetryError, the message
// is nacked (requeue=false), and the queue's dead-letter exchange takes it to
// a wait queue ("Dead Letter Exchanges"). No publish round trip is waited
// for, but the hop records no failure metadata, and it is only as safe as the
// queue's dead-lettering (at-least-once on quorum queues).
var ErrDeadLetter = errors.New("retry by dead-lettering the original")

// ErrNativeRetry is returned (possibly wrapped) by a Delayer that leaves the
// retry to the queue's own delayed retry (RabbitMQ 4.3+ quorum queues,
// x-delayed-retry-type "all"): the subscriber's nack with requeue puts the
// message into the queue's delayed state, and the queue delivers it again
// once the delay ends. It wraps ErrDeadLetter, so the republisher returns a
// *DeadLetterRetryError (with Native set) that the poison forwarder and the
// router's fallback pass through: the nack that follows is the retry.
//
// Like the dead-letter hop, a native retry publishes no copy, so it records
// no failure metadata: the next delivery is the original message as the
// producer sent it (plus the broker's x-acquired-count).
var ErrNativeRetry = fmt.Errorf("%w (native delayed retry: the queue holds the nacked original)", ErrDeadLetter)

// ExhaustedError is returned by the republisher when a retryable error
// happened on the last allowed attempt. The poison forwarder sends such
// messages to the poison queue with class "exhausted".
type ExhaustedError struct {
	Err      error
	Attempts int
}

// Error says how many attempts were made and why the last failed.
func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("gave up after %d attempts: %v", e.Attempts, e.Err)
}

// Unwrap returns the last handler error.
func (e *ExhaustedError) Unwrap() error { return e.Err }

// DeadLetterRetryError is returned when the Delayer chose dead-lettering
// (ErrDeadLetter), or the queue's native delayed retry (ErrNativeRetry,
// Native true): the nack that follows is the retry, not a failure. The
// poison forwarder passes it through.
type DeadLetterRetryError struct {
	HandlerErr error
	Attempt    int
	// Native: the retry is the queue's native delayed retry (a nack with
	// requeue), not a dead-lettering.
	Native bool
}

// Error says which attempt failed and that the broker takes the retry.
func (e *DeadLetterRetryError) Error() string {
	if e.Native {
		return fmt.Sprintf("attempt %d failed, retrying by the queue's native delayed retry: %v", e.Attempt, e.HandlerErr)
	}
	return fmt.Sprintf("attempt %d failed, retrying by dead-lettering: %v", e.Attempt, e.HandlerErr)
}

// Unwrap returns the handler error.
func (e *DeadLetterRetryError) Unwrap() error { return e.HandlerErr }

// ScheduleError is returned when the Delayer could not hold the retry copy.
// The message is then nacked, never acked: with amqpretry the broker
// dead-letters it into the wait path (see "Dead Letter Exchanges"); with
// other Pub/Subs it is redelivered according to their nack semantics.
type ScheduleError struct {
	Err        error // from Delayer.Schedule
	HandlerErr error
	Attempt    int
}

// Error describes both the scheduling failure and the handler error.
func (e *ScheduleError) Error() string {
	return fmt.Sprintf("scheduling retry after attempt %d failed: %v (handler error: %v)", e.Attempt, e.Err, e.HandlerErr)
}

// Unwrap returns the Delayer's error.
func (e *ScheduleError) Unwrap() error { return e.Err }

// ErrHandlerNotRun is (wrapped in) the HandlerErr of a ScheduleError raised
// before the handler ran: the RedeliveryGuard's copy of a redelivered
// message was not held.
var ErrHandlerNotRun = errors.New("handler not run")

// HandlerRan reports whether the handler ran and failed before the schedule
// failed (false for the RedeliveryGuard's copies).
func (e *ScheduleError) HandlerRan() bool { return !errors.Is(e.HandlerErr, ErrHandlerNotRun) }

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

// ErrorClass returns the class a failure is poisoned with (the error class
// key): package middleware sets it in its init (middleware.errorClass), so
// that the router's fallback records the same class without middleware
// exporting it. Nil until package middleware is initialised, which every
// importer of router is.
var ErrorClass func(err error) string

// Classified returns the action (a middleware.Action) and the class of the
// classification err carries (the Classifier's verdict, or a middleware's
// own, e.g. ActionNack / "interrupted" for a delivery already given back),
// ok false when it carries none. Package middleware sets it in its init,
// like ErrorClass; the router's fallback and the audit read it.
var Classified func(err error) (action int, class string, ok bool)

// RetryAfterError asks for the next attempt no earlier than After, e.g.
// from an HTTP 429 or 503 Retry-After header. middleware.RetryAfter makes
// it; the Classifier reads it into Classification.Delay.
type RetryAfterError struct {
	Err   error
	After time.Duration
}

// Error returns the wrapped error text with the requested delay.
func (e *RetryAfterError) Error() string {
	return fmt.Sprintf("%v (retry after %s)", e.Err, e.After)
}

// Unwrap returns the wrapped handler error.
func (e *RetryAfterError) Unwrap() error { return e.Err }

// RetryAfter returns the delay requested with middleware.RetryAfter, if
// any (a positive After).
func RetryAfter(err error) (time.Duration, bool) {
	var ra *RetryAfterError
	if errors.As(err, &ra) && ra.After > 0 {
		return ra.After, true
	}
	return 0, false
}
