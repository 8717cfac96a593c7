package middleware

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// MaxAttemptsCap is the hard cap on the attempt number: whatever headers a
// message carries, the counter never reports more than this, and
// RepublisherConfig.MaxAttempts cannot exceed it. So a forged or corrupted
// header cannot buy unbounded retries.
const MaxAttemptsCap = 1000

type attemptCtxKey struct{}

type provenCtxKey struct{}

// contextWithAttempt returns ctx carrying attempt (1-based).
func contextWithAttempt(ctx context.Context, attempt int) context.Context {
	return context.WithValue(ctx, attemptCtxKey{}, attempt)
}

// attemptFromContext returns the attempt number the AttemptCounter stored
// in ctx, and whether there was one.
func attemptFromContext(ctx context.Context) (int, bool) {
	if ctx == nil {
		return 0, false
	}
	n, ok := ctx.Value(attemptCtxKey{}).(int)
	return n, ok
}

// Attempt returns the attempt number (1 on the first delivery) of msg: the
// value the AttemptCounter put in the message's context; without a counter
// in the chain, the AttemptKey metadata of a copy of this queue's chain
// (HeaderSource with the router's subscribe topic) when it is a valid number
// in [1, MaxAttemptsCap] (a larger one reads as MaxAttemptsCap); else 1.
func Attempt(msg *message.Message) int {
	if n, ok := attemptFromContext(msg.Context()); ok {
		return n
	}
	prev, err := HeaderSource(nil).Previous(msg)
	if err != nil {
		return 1
	}
	return clampAttempt(1 + prev)
}

// ProvenAttempt returns the attempt number of msg counting only evidence
// proven by runs of the handler (see AttemptSource.Proven): the value the
// AttemptCounter put in the message's context; without a counter in the
// chain, the ProvenAttemptKey metadata of a copy of this queue's chain (its
// AttemptKey when the copy has none); else 1. It is never above Attempt(msg).
// The Republisher poisons a message past MaxAttempts without running it only
// when this number is past MaxAttempts too.
func ProvenAttempt(msg *message.Message) int {
	if n, ok := msg.Context().Value(provenCtxKey{}).(int); ok {
		return min(n, Attempt(msg))
	}
	if n, ok := attemptFromContext(msg.Context()); ok {
		return n // set by contextWithAttempt alone: all of it proven
	}
	src := HeaderSource(nil)
	prev, err := src.Proven(msg)
	if err != nil {
		return 1
	}
	return min(clampAttempt(1+prev), Attempt(msg))
}

func clampAttempt(n int64) int {
	if n < 1 {
		return 1
	}
	if n > MaxAttemptsCap {
		return MaxAttemptsCap
	}
	return int(n)
}

// AttemptSource reports how many attempts of a message already failed,
// according to one kind of evidence (a header, the broker's x-death, ...).
type AttemptSource struct {
	// Name identifies the source in logs and in HeaderErrorKey.
	Name string
	// Previous returns the number of earlier failed attempts this source
	// knows about: 0 when it has no evidence. It returns an error for a
	// malformed value (non-numeric, negative); the counter then ignores the
	// source for this message and records the error. A value too large for
	// int64 must be returned as MaxAttemptsCap, not as an error.
	Previous func(msg *message.Message) (int64, error)
	// Proven returns the part of Previous that is proven by runs of the
	// handler: failed attempts this queue's chain recorded after running it
	// (its own attempt header, x-death "rejected"/"delivery_limit" entries,
	// the native delayed retry's nacks). It is the place for evidence that
	// may also count returns of the message that did not run the handler,
	// such as RabbitMQ 4.3's x-acquired-count, which also rises when the
	// RedeliveryGuard or the Pause hands a delivery back unprocessed (nack
	// with requeue during a broker alarm, or at shutdown while held): such a
	// source returns less than Previous here (amqpwire.NackCountSource returns 0).
	// The counter sums it into the proven attempt number (ProvenAttempt);
	// values above Previous read as Previous, errors count 0. nil: all of
	// Previous is proven (the behaviour of sources written before this
	// field existed).
	Proven func(msg *message.Message) (int64, error)
}

// proven returns the proven part of s's count for msg, in [0, previous].
func (s AttemptSource) proven(msg *message.Message, previous int64) int64 {
	if s.Proven == nil || previous == 0 {
		return previous // nothing to prove (the common case: a first delivery)
	}
	n, err := s.Proven(msg)
	if err != nil || n < 0 {
		return 0
	}
	return min(n, previous)
}

// parseCount parses a non-negative decimal count. Out-of-range positive
// values read as MaxAttemptsCap; negative or non-numeric values are errors.
func parseCount(key, v string) (int64, error) {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		var ne *strconv.NumError
		if errors.As(err, &ne) && errors.Is(ne.Err, strconv.ErrRange) && len(v) > 0 && v[0] != '-' {
			return MaxAttemptsCap, nil
		}
		return 0, fmt.Errorf("%s=%.40q is not a decimal number", key, v)
	}
	if n < 0 {
		return 0, fmt.Errorf("%s=%d is negative", key, n)
	}
	if n > MaxAttemptsCap {
		return MaxAttemptsCap, nil
	}
	return n, nil
}

// ownCopy reports whether msg, consumed from queue, is a copy the library
// itself published for that queue, so that the AttemptKey it carries was
// written by this queue's retry chain and counts. With the amqpretry
// Marshaler (any delivery it produced has DeliveryExchangeKey), that is
// DeliveryRetryPathKey, which it derives from the delivery itself (its
// exchange and routing key, and the dead-lettering the broker recorded in
// x-death and x-first-death-*), never from a library header: a producer
// publishing to a business exchange cannot make its message one. With a
// transport that carries no such evidence (gochannel and the MemoryDelayer),
// it is OriginalQueueKey == queue, which RecordFailure writes on every
// retry copy: a message from another queue's chain or a producer's message
// without that key never is one (an in-process publisher that copies
// OriginalQueueKey of this very queue can still pass). With queue "" (not
// known, e.g. outside a message.Router) there is nothing to compare, and a
// message without transport evidence counts as a copy.
func ownCopy(msg *message.Message, queue string) bool {
	if _, amqp := msg.Metadata[retrymeta.DeliveryExchangeKey]; amqp {
		return msg.Metadata.Get(retrymeta.DeliveryRetryPathKey) == "true"
	}
	return queue == "" || msg.Metadata.Get(OriginalQueueKey) == queue
}

// HeaderSource reads the library's own AttemptKey header, written by the
// delayed republisher (and the RedeliveryGuard, the fallback) on every copy
// it schedules, but only on a copy of this queue's chain (ownCopy with
// queue(msg)): on any other delivery (a producer's message, one that
// carries another queue's count, a first delivery here) the header says
// nothing about this queue and counts 0, so the handler runs. The header
// holds the attempt number of that delivery, so it contributes value-1
// earlier attempts. Absent: 0. Non-numeric, negative or zero: an error
// (ignored by the counter). Larger than MaxAttemptsCap (including values
// that overflow int64): MaxAttemptsCap.
//
// Its Proven part is ProvenAttemptKey (the attempt number proven by runs,
// written beside AttemptKey on the same copies) minus 1, or all of it on a
// copy without that key.
//
// queue returns the consuming queue's name; nil means the router's
// subscribe topic (message.SubscribeTopicFromCtx).
func HeaderSource(queue func(msg *message.Message) string) AttemptSource {
	if queue == nil {
		queue = func(msg *message.Message) string { return message.SubscribeTopicFromCtx(msg.Context()) }
	}
	previous := func(msg *message.Message, key string) (int64, bool, error) {
		v, ok := msg.Metadata[key]
		if !ok || !ownCopy(msg, queue(msg)) {
			return 0, false, nil
		}
		n, err := parseCount(key, v)
		if err != nil {
			return 0, false, err
		}
		if n == 0 {
			return 0, false, fmt.Errorf("%s=0 is not an attempt number (attempts start at 1)", key)
		}
		return n - 1, true, nil
	}
	return AttemptSource{Name: "header", Previous: func(msg *message.Message) (int64, error) {
		n, _, err := previous(msg, AttemptKey)
		return n, err
	}, Proven: func(msg *message.Message) (int64, error) {
		// ProvenAttemptKey, written with AttemptKey on every copy; a copy
		// made before it existed has only AttemptKey, all of it proven.
		if n, ok, err := previous(msg, retrymeta.ProvenAttemptKey); ok && err == nil {
			return n, nil
		}
		n, _, err := previous(msg, AttemptKey)
		return n, err
	}}
}

// AttemptCounterConfig configures an AttemptCounter.
type AttemptCounterConfig struct {
	// Sources are summed: attempt = 1 + sum of Previous over all sources,
	// clamped to [1, MaxAttemptsCap]. Default: HeaderSource(nil) only (the
	// broker's counts, x-death and the quorum-queue headers, are the
	// attempt sources of package amqpwire, which amqpretry.New adds).
	Sources []AttemptSource
	// Logger logs ignored malformed values at Info level. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *AttemptCounterConfig) setDefaults() {
	if len(c.Sources) == 0 {
		c.Sources = []AttemptSource{HeaderSource(nil)}
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports a source without Name or Previous.
func (c AttemptCounterConfig) Validate() error {
	for i, s := range c.Sources {
		if s.Name == "" {
			return fmt.Errorf("AttemptCounterConfig.Sources[%d].Name is empty", i)
		}
		if s.Previous == nil {
			return fmt.Errorf("AttemptCounterConfig.Sources[%d].Previous is nil", i)
		}
	}
	return nil
}

// AttemptCounter works out the attempt number of each delivery and puts it in
// the message's context (Attempt) and metadata (AttemptKey), where
// handlers (Attempt(msg)) and the other middlewares read it.
type AttemptCounter struct {
	sources []AttemptSource
	logger  watermill.LoggerAdapter
}

// NewAttemptCounter returns a counter, or the error of cfg.Validate.
func NewAttemptCounter(cfg AttemptCounterConfig) (*AttemptCounter, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &AttemptCounter{sources: cfg.Sources, logger: cfg.Logger}, nil
}

// count returns the attempt number, the proven attempt number (only the
// Proven parts of the sources; never above the attempt number) and the
// ignored malformed values.
func (c *AttemptCounter) count(msg *message.Message) (int, int, string) {
	var prev, proven int64
	var bad string
	for _, s := range c.sources {
		n, err := s.Previous(msg)
		if err != nil {
			bad = appendBad(bad, s.Name, err)
			continue
		}
		prev = min(prev+n, MaxAttemptsCap)
		proven = min(proven+s.proven(msg, n), MaxAttemptsCap)
	}
	return clampAttempt(1 + prev), clampAttempt(1 + proven), bad
}

// Count returns the attempt number of msg in [1, MaxAttemptsCap], and a
// description of malformed values it ignored ("" if none).
func (c *AttemptCounter) Count(msg *message.Message) (int, string) {
	n, _, bad := c.count(msg)
	return n, bad
}

// appendBad adds source name's error to the list bad. Out of line: count
// stays small on the stack (it runs on a fresh goroutine per message).
//
//go:noinline
func appendBad(bad, name string, err error) string {
	if bad != "" {
		bad += "; "
	}
	return bad + name + ": " + err.Error()
}

// Middleware stores the attempt number (AttemptKey, and in the context for Attempt) and
// the proven attempt number (in the context, for ProvenAttempt; every copy
// the chain writes carries it as rabbitretry-proven-attempt) and calls the
// handler.
func (c *AttemptCounter) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		c.store(msg)
		return h(msg)
	}
}

// store counts msg's attempt and stores both numbers. Out of line, so that
// the frame that stays on the stack below the handler is small: the router
// runs each message on a fresh goroutine, whose stack starts small and is
// copied when it grows.
//
//go:noinline
func (c *AttemptCounter) store(msg *message.Message) {
	n, proven, bad := c.count(msg)
	if bad != "" {
		msg.Metadata.Set(retrymeta.HeaderErrorKey, bad)
		c.logger.Info("Ignoring malformed attempt headers", watermill.LogFields{
			"message_uuid": msg.UUID, "problem": bad, "attempt": n,
		})
	}
	msg.Metadata.Set(AttemptKey, strconv.Itoa(n))
	// The proven number lives in the context (ProvenAttempt); every copy
	// the chain writes sets ProvenAttemptKey from it. Only a header that
	// came with the delivery is overwritten, so that no copy can carry a
	// stale one: one key fewer per message keeps a message with a couple
	// of headers in Go's small-map form (8 entries), instead of growing
	// the map on the handler goroutine.
	if _, ok := msg.Metadata[retrymeta.ProvenAttemptKey]; ok {
		msg.Metadata[retrymeta.ProvenAttemptKey] = strconv.Itoa(proven)
	}
	msg.SetContext(&attemptCtx{Context: msg.Context(), attempt: n, proven: proven})
}

// attemptCtx is ContextWithAttempt(ctx, attempt) with proven under
// provenCtxKey: one context (one allocation) for both.
type attemptCtx struct {
	context.Context
	attempt, proven int
}

func (c *attemptCtx) Value(key any) any {
	switch key.(type) {
	case attemptCtxKey:
		return c.attempt
	case provenCtxKey:
		return c.proven
	}
	return c.Context.Value(key)
}
