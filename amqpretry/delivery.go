package amqpretry

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// deliveries remembers, for each message the Marshaler unmarshaled and the
// chain has not finished yet, the channel its delivery arrived on, so the
// chain can tell whether the delivery can still be acked. The chain's entry
// (Retry.Middleware) forgets the message when it returns.
//
// Why: an ack on a channel that closed (connection lost, consumer process
// killed, RabbitMQ 3.x closing the channel on consumer_timeout) or whose
// consumer the broker cancelled (RabbitMQ 4.x quorum queues on
// consumer_timeout, a deleted queue) is void: the broker has already
// returned the message to its queue ("Consumer Acknowledgements and
// Publisher Confirms", "Delivery Acknowledgement Timeout"). Publishing a
// retry or poison copy for such a delivery would fork the message.
//
// Keys are weak pointers, so a message unmarshaled but never handed to the
// chain (the subscriber was closing) does not keep its payload alive.
var deliveries sync.Map // weak.Pointer[message.Message] -> *deliveryChannel

// channels holds one deliveryChannel per AMQP channel seen, so that the
// consumer-cancel listener is registered once per channel, not per message.
var channels sync.Map // *amqp.Channel -> *deliveryChannel

type deliveryChannel struct {
	ch        *amqp.Channel
	cancelled atomic.Bool
}

// trackDelivery records the channel of d for msg.
func trackDelivery(msg *message.Message, d *amqp.Delivery) {
	ch, ok := d.Acknowledger.(*amqp.Channel)
	if !ok || ch == nil {
		return
	}
	dc, loaded := channels.Load(ch)
	if !loaded {
		fresh := &deliveryChannel{ch: ch}
		if dc, loaded = channels.LoadOrStore(ch, fresh); !loaded {
			watchChannel(fresh)
		}
	}
	deliveries.Store(weak.Make(msg), dc)
}

// watchChannel marks dc cancelled on basic.cancel from the broker and forgets
// it when the channel closes (amqp091-go closes the notify channels then).
func watchChannel(dc *deliveryChannel) {
	cancels := dc.ch.NotifyCancel(make(chan string, 1))
	go func() {
		for range cancels {
			dc.cancelled.Store(true)
		}
		channels.Delete(dc.ch)
	}()
}

// deliveryAlive reports whether msg's delivery can still be acked: false if
// its channel closed or its consumer was cancelled. Messages not unmarshaled
// by the Marshaler (gochannel, tests) count as alive. Inside
// Retry.Middleware the delivery's channel is in the run's state (runOf).
func deliveryAlive(msg *message.Message) bool {
	if st := runOf(msg); st != nil {
		return st.alive()
	}
	v, ok := deliveries.Load(weak.Make(msg))
	if !ok {
		return true
	}
	return v.(*deliveryChannel).alive()
}

func (dc *deliveryChannel) alive() bool { return !dc.ch.IsClosed() && !dc.cancelled.Load() }

// takeDelivery returns the channel trackDelivery recorded for msg (nil if
// none) and forgets it.
func takeDelivery(msg *message.Message) *deliveryChannel {
	v, ok := deliveries.LoadAndDelete(weak.Make(msg))
	if !ok {
		return nil
	}
	return v.(*deliveryChannel)
}

// runState is what Retry.Middleware knows about one run of the chain on a
// message: its delivery's channel, the identity of the delivery as it
// arrived (for lateVerdicts), and the handler's result. It travels in the
// message's context (runCtx), so the chain's inner parts (recordVerdict,
// the Classifier's DeliveryAlive) reach it without a lookup in a global
// map.
type runState struct {
	dc *deliveryChannel // nil: not tracked (not from the Marshaler): alive

	// uuid, attempt and redeliveries as delivered, before the chain set
	// anything: lateKey's parts.
	uuid, attempt, redeliveries string

	start time.Time // when the run reached the chain (markStart); zero: not marked

	// The handler deadline worked out at the chain's start
	// (deadlines.prepare), for deadlines.wrap: done there, the lookup and
	// the allocation stay off the handler goroutine's deepest frames.
	prepared bool
	deadline time.Duration    // 0: none applies
	dl       *lazyDeadlineCtx // its context (&dlCtx), parent set by wrap
	dlCtx    lazyDeadlineCtx

	// Set at the run's start (Retry.begin) and by recordVerdict, so that
	// the chain's outermost and innermost frames keep nothing but the
	// runState across their calls (Retry.end, runState.finish).
	msg   *message.Message
	retry *Retry
	rec   *verdictRecorder

	mu        sync.Mutex
	replay    atomic.Bool // return replayErr instead of running the handler (once)
	replayErr error       // set before replay
	ran       bool        // the handler ran; err is its result
	err       error
}

func (st *runState) alive() bool { return st.dc == nil || st.dc.alive() }

// key is lateKey of the delivery.
func (st *runState) key() string { return lateKeyOf(st.uuid, st.attempt, st.redeliveries) }

// verdict returns the handler's result, if it ran.
func (st *runState) verdict() (verdict, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	return verdict{err: st.err}, st.ran
}

type runStateKey struct{}

// runCtx carries a runState: one allocation for both the context and the
// state.
type runCtx struct {
	context.Context
	st runState
}

func (c *runCtx) Value(key any) any {
	if _, ok := key.(runStateKey); ok { // no runtime.efaceeq call (frame)
		return &c.st
	}
	return c.Context.Value(key)
}

// beginRun starts a run of Retry.Middleware's chain on msg: it takes msg's
// tracked delivery and puts a fresh runState in msg's context.
func beginRun(msg *message.Message) *runState {
	c := &runCtx{Context: msg.Context()}
	c.st.dc = takeDelivery(msg)
	c.st.uuid = msg.UUID
	c.st.attempt = msg.Metadata[middleware.AttemptKey]
	c.st.redeliveries = msg.Metadata[retrymeta.RedeliveriesKey]
	msg.SetContext(c)
	return &c.st
}

// runOf returns the runState of the Retry.Middleware run msg is in, or nil.
func runOf(msg *message.Message) *runState {
	st, _ := msg.Context().Value(runStateKey{}).(*runState)
	return st
}

// trackingMarshaler is the Marshaler the subscriber gets from
// Retry.SubscriberConfig: Marshaler plus trackDelivery.
type trackingMarshaler struct{ Marshaler }

// Unmarshal is Marshaler.Unmarshal, remembering the delivery's channel.
func (m trackingMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	msg, err := m.Marshaler.Unmarshal(d)
	if err == nil {
		trackDelivery(msg, &d)
	}
	return msg, err
}
