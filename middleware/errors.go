package middleware

import (
	"errors"
	"fmt"
)

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

// errHandlerNotRun is (wrapped in) the HandlerErr of a ScheduleError raised
// before the handler ran: the RedeliveryGuard's copy of a redelivered
// message was not held.
var errHandlerNotRun = errors.New("handler not run")

// HandlerRan reports whether the handler ran and failed before the schedule
// failed (false for the RedeliveryGuard's copies).
func (e *ScheduleError) HandlerRan() bool { return !errors.Is(e.HandlerErr, errHandlerNotRun) }
