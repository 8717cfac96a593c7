package amqpretry

import (
	"container/list"
	"context"
	"errors"
	"sync"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// errDeliveryGone is returned, without running the handler, for a message
// whose delivery the broker already took back before the handler started.
// errStopping is returned, without running the handler or copying
// anything, for a message whose context had already ended when the chain
// got it: the router is stopping (it cancels the subscribe context before
// it closes the subscriber) and watermill-amqp's plain subscriber, which
// can still hand out a message then, nacks it on close whatever the chain
// decides. Acting on it could only leave a copy beside a requeued
// original. With Retry.NewSubscriber no message is handed out that way.
var errStopping = errors.New("amqpretry: the message's context ended before the chain ran it (the router is stopping); it goes back to the queue unprocessed")

var errDeliveryGone = errors.New("amqpretry: the broker took this delivery back before it ran (channel closed or consumer cancelled, e.g. by a consumer timeout); it is redelivered")

// lateVerdicts remembers the handler's result (nil or its error) for
// messages whose handler finished after the broker had taken their delivery
// back (its channel closed, or its consumer cancelled by a consumer
// timeout: "Delivery Acknowledgement Timeout"), so the result could not be
// settled. When the broker redelivers such a message to this process, the
// remembered result is settled instead of running the handler again: a
// success is acked, a failure retried or poisoned as usual, and the
// redelivery is not counted as a crash. Bounded: the oldest entries are
// forgotten first (a forgotten one just runs again: at-least-once).
type lateVerdicts struct {
	mu    sync.Mutex
	max   int
	order *list.List // of string keys, oldest first
	keys  map[string]*list.Element
	errs  map[string]error
}

const maxLateVerdicts = 4096

func newLateVerdicts() *lateVerdicts {
	return &lateVerdicts{max: maxLateVerdicts, order: list.New(), keys: map[string]*list.Element{}, errs: map[string]error{}}
}

// lateKey identifies one copy of a message: its UUID, attempt and
// redelivery count as delivered, before the chain sets anything (a later
// retry copy of the same message has another key; a redelivery of the same
// delivery has the same).
func lateKey(msg *message.Message) string {
	return lateKeyOf(msg.UUID, msg.Metadata.Get(middleware.AttemptKey), msg.Metadata.Get(retrymeta.RedeliveriesKey))
}

func lateKeyOf(uuid, attempt, redeliveries string) string {
	return uuid + "\x00" + attempt + "\x00" + redeliveries
}

func (l *lateVerdicts) add(k string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.keys[k]; !ok {
		l.keys[k] = l.order.PushBack(k)
	}
	l.errs[k] = err
	for l.order.Len() > l.max {
		oldest := l.order.Front()
		l.order.Remove(oldest)
		delete(l.keys, oldest.Value.(string))
		delete(l.errs, oldest.Value.(string))
	}
}

// take returns the remembered result of the message with key k, forgetting
// it; ok is false when there is none.
func (l *lateVerdicts) take(k string) (err error, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.keys[k]
	if ok {
		err = l.errs[k]
		l.order.Remove(e)
		delete(l.keys, k)
		delete(l.errs, k)
	}
	return err, ok
}

// verdict is a handler's result.
type verdict struct{ err error }

// recordVerdict wraps the user's handler: it returns a replayed result
// without running h, or runs h and records its result, in the run's state
// (runOf; without one it just runs h).
// It also puts the handler deadline on h's context (deadlines.wrap; d
// nil: none).
func recordVerdict(d *deadlines, queueName func(context.Context) string, h message.HandlerFunc) message.HandlerFunc {
	v := &verdictRecorder{d: d, queueName: queueName, h: h, wrapped: d.wrap(queueName, h)}
	// The healthy path: this frame is under the handler's, at the deepest
	// point of a goroutine the router starts per message, whose stack
	// starts at 2 KB and is copied when it grows (measured: one copy per
	// message cost more than the whole chain). So it keeps few values
	// live across h, calls out of line with few arguments, and leaves
	// every rare case to slow. (A closure, not a method value: that adds
	// a wrapper frame.) With the handler deadline disabled (d nil) no run
	// is prepared and enter does nothing: the same path.
	return func(msg *message.Message) ([]*message.Message, error) {
		st := runOf(msg)
		if st == nil || st.replay.Load() || (!st.prepared && d != nil) {
			return v.slow(st, msg)
		}
		v.d.enter(st, msg)
		st.rec = v
		return st.finish(v.h(msg))
	}
}

// finish ends the handler's run under its deadline (verdictRecorder.leave)
// and records its result. Called with h's results directly, so that
// recordVerdict's frame keeps nothing but st across h.
//
//go:noinline
func (st *runState) finish(out []*message.Message, err error) ([]*message.Message, error) {
	if st.dl != nil {
		st.rec.leave(st.dl, st.msg, err)
	}
	st.record(err)
	return out, err
}

// verdictRecorder is recordVerdict's state.
type verdictRecorder struct {
	d         *deadlines
	queueName func(context.Context) string
	h         message.HandlerFunc
	wrapped   message.HandlerFunc // h under d.wrap
}

// slow is recordVerdict's rare cases: no run state, a replayed result, a
// run whose deadline was not prepared.
//
//go:noinline
func (v *verdictRecorder) slow(st *runState, msg *message.Message) ([]*message.Message, error) {
	if st == nil {
		return v.wrapped(msg)
	}
	if st.replay.Load() {
		if err, ok := st.takeReplay(); ok {
			return nil, err
		}
	}
	if !st.prepared {
		out, err := v.wrapped(msg)
		st.record(err)
		return out, err
	}
	// wrap's work, without its context lookup.
	v.d.enter(st, msg)
	st.rec = v
	return st.finish(v.h(msg))
}

// leave restores the chain's context after the handler ran under ctx,
// ends ctx's timer (if the handler made one) and logs a failure its
// deadline explains. No defer in run (its frame cost a stack copy per
// message): after a panic (recovered by a router middleware), ctx's
// timer, if the handler made one, ends at the deadline.
//
//go:noinline
func (v *verdictRecorder) leave(ctx *lazyDeadlineCtx, msg *message.Message, err error) {
	if msg.Context() == ctx {
		msg.SetContext(ctx.Context)
	}
	if err != nil {
		v.d.failed(ctx, ctx.timeout, v.queueName, msg)
	}
	ctx.stop()
}

// record keeps the handler's result in its run's state.
func (st *runState) record(err error) {
	st.mu.Lock()
	st.ran, st.err = true, err
	st.mu.Unlock()
}

// takeReplay returns the remembered result to settle instead of running the
// handler, once.
func (st *runState) takeReplay() (error, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if !st.replay.CompareAndSwap(true, false) {
		return nil, false
	}
	return st.replayErr, true
}

// classicTimeoutIgnored reports whether broker version v ignores consumer
// timeouts on a queue of type queueType: RabbitMQ 4.3 evaluates
// consumer_timeout (and x-consumer-timeout, the consumer-timeout policy)
// for quorum queues only (4.3.0 release notes), so on a classic queue a
// hung handler holds its delivery until its connection closes.
func classicTimeoutIgnored(v, queueType string) bool {
	major, minor, ok := parseMajorMinor(v)
	return ok && queueType == QueueTypeClassic && (major > 4 || (major == 4 && minor >= 3))
}

// explicitConsumerTimeout returns the x-consumer-timeout cfg sets on the
// queue or the consumer, if any.
func explicitConsumerTimeout(cfg wamqp.Config) (any, bool) {
	if v, ok := cfg.Queue.Arguments["x-consumer-timeout"]; ok {
		return v, true
	}
	v, ok := cfg.Consume.Arguments["x-consumer-timeout"]
	return v, ok
}
