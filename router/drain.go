package router

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// defaultDrainTimeout is the default drain timeout of NewDrainingSubscriber:
// below watermill's default Router CloseTimeout (30 s), so the router still
// sees its handlers finish.
const defaultDrainTimeout = 20 * time.Second

// ackFlushGrace is how long Close waits, once every message handed out was
// acked or nacked, before it closes an inner subscriber that does not say
// when it has sent its acks (see endsMessageContexts), so that its
// goroutines send them first.
const ackFlushGrace = 100 * time.Millisecond

// endsMessageContexts reports whether inner ends the context it gives each
// message once it has sent that message's ack or nack to the broker:
// watermill-amqp's Subscriber and watermill's GoChannel do (their
// processMessage / sendMessageToSubscriber cancel it on return), and a
// subscriber that says so with a SettledContexts method (amqpretry's
// quarantine subscriber).
func endsMessageContexts(inner message.Subscriber) bool {
	if _, ok := inner.(interface{ SettledContexts() }); ok {
		return true
	}
	if _, ok := inner.(*gochannel.GoChannel); ok {
		return true
	}
	t := reflect.TypeOf(inner)
	return t != nil && t.Kind() == reflect.Pointer &&
		t.Elem().PkgPath() == "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp" && t.Elem().Name() == "Subscriber"
}

// DrainingSubscriber wraps a message.Subscriber so that stopping the router
// (cancelling the context given to message.Router.Run, or Router.Close,
// which closes the router's subscribers) lets the messages already handed to
// handlers finish first, and only then closes the inner subscriber.
//
// Why: watermill-amqp's Subscriber.Close nacks every in-flight delivery at
// once while its handler is still running. The handler's result is then
// lost: a success is not acked (the message runs again after the restart),
// and a failure on the last attempt races the redelivery. With this wrapper
// a graceful shutdown interrupts no handler: each in-flight message is
// acked, retried or poisoned by the chain as usual, then the inner
// subscriber closes. A message received from the inner subscriber after
// Close began is not handed out: it is nacked (returned to the broker,
// unprocessed).
//
// Both Watermill stops work and take the drain time of what is in flight
// (none when idle):
//   - The subscribe context ends (Router.Run's context cancelled by a
//     signal or a timeout, Handler.Stop, or Router.Close, which cancels it
//     too): the subscription stops handing out messages and closes its
//     channel, so the router's handler stops; once the messages it handed
//     out are acked or nacked (at most the drain timeout), the inner
//     subscription ends: when no other subscription's context is live, by
//     Close (so the subscriber is closed after such a stop, and Subscribe
//     returns middleware.ErrClosed), otherwise (Handler.Stop of one of
//     several handlers sharing the subscriber) by cancelling its inner
//     context.
//     The inner subscription's context is not the subscribe context: the
//     messages' contexts derive from it, and the handlers being drained must
//     not see context.Canceled.
//   - Close (Router.Close calls it): as above for every subscription.
//
// A message counts as in flight until the inner subscriber has sent its
// ack or nack: watermill-amqp's Subscriber (v2), watermill's GoChannel and
// amqpretry's quarantine subscriber end the context they give a message
// once they have, and Close waits for that; for any other inner subscriber
// it pauses 100 ms after the last ack instead. Closing watermill-amqp's
// subscriber earlier could nack a delivery the router just acked.
//
// Close waits at most the drain timeout for in-flight messages; past it the
// inner subscriber is closed anyway (its nack returns the rest to the
// broker, and watermill-amqp cancels their contexts) and Close reports the
// timeout. DrainingSubscriber is safe for concurrent use.
type DrainingSubscriber struct {
	inner   message.Subscriber
	timeout time.Duration

	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error

	inflight   sync.WaitGroup
	forwarders sync.WaitGroup
	// innerSettles: inner ends each message's context once its ack or nack
	// is sent (endsMessageContexts); a message in flight is then done only
	// after that.
	innerSettles bool
	// settled: a message handed out was acked or nacked (see
	// ackFlushGrace); only without innerSettles.
	settled atomic.Bool

	mu   sync.Mutex
	subs map[*subscription]struct{} // not yet stopped by their context
	all  []*subscription
}

// subscription is one Subscribe call.
type subscription struct {
	ctx      context.Context    // the subscribe context
	cancel   context.CancelFunc // ends the inner subscription
	inflight sync.WaitGroup     // handed out, not yet acked or nacked
}

// NewDrainingSubscriber wraps inner. timeout bounds the wait for in-flight
// messages when the router stops (Close, or the subscribe context ending);
// 0 means 20 s (defaultDrainTimeout).
func NewDrainingSubscriber(inner message.Subscriber, timeout time.Duration) *DrainingSubscriber {
	if timeout <= 0 {
		timeout = defaultDrainTimeout
	}
	return &DrainingSubscriber{inner: inner, timeout: timeout, closing: make(chan struct{}), subs: map[*subscription]struct{}{},
		innerSettles: endsMessageContexts(inner)}
}

// errSubscriberClosed (middleware.ErrClosed) is returned by Subscribe after
// Close, and after the context of the last subscription ended (which closes
// the subscriber).
var errSubscriberClosed = fmt.Errorf("router: subscriber: %w", middleware.ErrClosed)

// Subscribe subscribes the inner subscriber and forwards its messages,
// tracking each until the router acks or nacks it. When ctx ends, the
// returned channel is closed and the subscription drains (see
// DrainingSubscriber).
func (s *DrainingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if !s.track(&s.forwarders) {
		return nil, errSubscriberClosed
	}
	// watermill-amqp derives each message's context from the subscribe
	// context: the inner subscription gets one that ends only when this
	// subscription has drained, so the handlers being drained do not see
	// context.Canceled.
	innerCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	in, err := s.inner.Subscribe(innerCtx, topic)
	if err != nil {
		cancel()
		s.forwarders.Done()
		return nil, err
	}
	sub := &subscription{ctx: ctx, cancel: cancel}
	s.mu.Lock()
	s.subs[sub] = struct{}{}
	s.all = append(s.all, sub)
	s.mu.Unlock()
	out := make(chan *message.Message)
	go s.forward(ctx, sub, in, out)
	return out, nil
}

// track adds one to wg unless Close has begun: Adds and Close's closing are
// ordered by s.mu, so no Add runs concurrently with Close's Wait.
func (s *DrainingSubscriber) track(wg *sync.WaitGroup) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.closing:
		return false
	default:
		wg.Add(1)
		return true
	}
}

func (s *DrainingSubscriber) forward(ctx context.Context, sub *subscription, in <-chan *message.Message, out chan<- *message.Message) {
	defer s.forwarders.Done()
	defer close(out)
	for {
		select {
		case <-s.closing:
			return
		case <-ctx.Done():
			// Stopped by the context: nothing more is handed out (a message
			// the inner subscriber still holds is nacked when it closes).
			go s.stopSubscription(sub, in)
			return
		case msg, ok := <-in:
			if !ok {
				return
			}
			if !s.track(&s.inflight) {
				msg.Nack() // not handed out: back to the broker, unprocessed
				return
			}
			sub.inflight.Add(1)
			// The inner subscriber's context for msg (the chain replaces
			// msg's own as it runs).
			innerCtx := msg.Context()
			go func() {
				defer s.inflight.Done()
				defer sub.inflight.Done()
				select {
				case <-msg.Acked():
				case <-msg.Nacked():
				}
				if !s.innerSettles {
					s.settled.Store(true)
					return
				}
				// The router's Ack only signals the inner subscriber; its own
				// goroutine then sends the AMQP ack, and ends innerCtx. Close
				// must not close it before: watermill-amqp v2 waits for the
				// signal in a select that also watches its closing and picks
				// at random when both are ready, so a close now could turn a
				// just-acked delivery into a nack (a success run twice).
				<-innerCtx.Done()
			}()
			// Received before the stop: handed out (the router reads its
			// channel until it is closed), so it is not returned unprocessed.
			select {
			case out <- msg:
			case <-s.closing:
				msg.Nack()
				return
			}
		}
	}
}

// stopSubscription ends sub after its context ended. When no subscription's
// context is still live (Router.Run's context ends all of them), it closes
// the subscriber (Close drains every
// message handed out). Otherwise it waits (at most the drain timeout) for
// the messages sub handed out, then cancels sub's inner subscription and
// nacks what that still delivers.
func (s *DrainingSubscriber) stopSubscription(sub *subscription, in <-chan *message.Message) {
	s.mu.Lock()
	delete(s.subs, sub)
	last := true // Router.Run's context ends every subscription at once
	for o := range s.subs {
		if o.ctx.Err() == nil {
			last = false
			break
		}
	}
	s.mu.Unlock()
	if last {
		_ = s.Close() // its result is kept: the owner's Close returns it
		return
	}
	done := make(chan struct{})
	go func() {
		sub.inflight.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(s.timeout):
	}
	sub.cancel()
	for msg := range in {
		msg.Nack()
	}
}

// Draining returns a channel closed once Close has begun: handlers still
// running then will finish before the inner subscriber closes.
func (s *DrainingSubscriber) Draining() <-chan struct{} { return s.closing }

// Close stops handing out messages, waits (at most the drain timeout) until
// every message already handed out is acked or nacked, then closes the inner
// subscriber. It returns the inner Close error, joined with a timeout error
// if the drain did not finish. Later calls (and concurrent ones, which wait
// for the first) return the same result.
func (s *DrainingSubscriber) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		close(s.closing)
		s.mu.Unlock()
		done := make(chan struct{})
		go func() {
			s.inflight.Wait()
			close(done)
		}()
		var drainErr error
		select {
		case <-done:
		case <-time.After(s.timeout):
			drainErr = errors.New("router: in-flight messages did not finish within the drain timeout; the inner subscriber returns them to the broker")
		}
		if s.settled.Load() {
			// An inner subscriber that does not say when its acks are sent
			// (see forward): give its goroutines a moment to send them.
			time.Sleep(ackFlushGrace)
		}
		s.closeErr = errors.Join(drainErr, s.inner.Close())
		s.mu.Lock()
		for _, sub := range s.all {
			sub.cancel()
		}
		s.mu.Unlock()
		s.forwarders.Wait()
	})
	return s.closeErr
}

// SubscribeInitialize passes through to the inner subscriber when it
// implements message.SubscribeInitializer (watermill-amqp's does: it
// declares the topology).
func (s *DrainingSubscriber) SubscribeInitialize(topic string) error {
	if si, ok := s.inner.(message.SubscribeInitializer); ok {
		return si.SubscribeInitialize(topic)
	}
	return nil
}

// String names the wrapped subscriber, e.g. "amqp.Subscriber", as Watermill
// would name it unwrapped (its Stringer, else its type without the pointer
// marker): Watermill's router logs subscribers by this name and the
// PoisonForwarder writes it into subscriber_poisoned, where
// "router.DrainingSubscriber" would say nothing about the source.
func (s *DrainingSubscriber) String() string {
	if st, ok := s.inner.(fmt.Stringer); ok {
		return st.String()
	}
	return strings.TrimLeft(fmt.Sprintf("%T", s.inner), "*")
}
