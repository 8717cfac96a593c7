package router

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// DefaultDrainTimeout is the default drain timeout of NewDrainingSubscriber:
// below watermill's default Router CloseTimeout (30 s), so the router still
// sees its handlers finish.
const DefaultDrainTimeout = 20 * time.Second

// DrainingSubscriber wraps a message.Subscriber so that closing it (which
// message.Router does on Close) lets the messages already handed to
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
// Close waits at most the drain timeout for in-flight messages; past it the
// inner subscriber is closed anyway (its nack returns the rest to the
// broker) and Close reports the timeout. DrainingSubscriber is safe for
// concurrent use.
type DrainingSubscriber struct {
	inner   message.Subscriber
	timeout time.Duration

	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error

	inflight   sync.WaitGroup
	forwarders sync.WaitGroup

	mu      sync.Mutex
	cancels []context.CancelFunc
}

// NewDrainingSubscriber wraps inner. timeout bounds Close's wait for
// in-flight messages; 0 means DefaultDrainTimeout.
func NewDrainingSubscriber(inner message.Subscriber, timeout time.Duration) *DrainingSubscriber {
	if timeout <= 0 {
		timeout = DefaultDrainTimeout
	}
	return &DrainingSubscriber{inner: inner, timeout: timeout, closing: make(chan struct{})}
}

// ErrSubscriberClosed is returned by Subscribe after Close.
var ErrSubscriberClosed = errors.New("router: subscriber closed")

// Subscribe subscribes the inner subscriber and forwards its messages,
// tracking each until the router acks or nacks it.
func (s *DrainingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if !s.track(&s.forwarders) {
		return nil, ErrSubscriberClosed
	}
	// watermill's Router cancels the subscribe context when it closes, at the
	// same time as it closes its subscribers, and watermill-amqp derives each
	// message's context from it: the handlers being drained would see
	// context.Canceled. The inner subscription gets a context that ends only
	// when Close has drained (the Router always closes its subscribers).
	innerCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	in, err := s.inner.Subscribe(innerCtx, topic)
	if err != nil {
		cancel()
		s.forwarders.Done()
		return nil, err
	}
	s.mu.Lock()
	s.cancels = append(s.cancels, cancel)
	s.mu.Unlock()
	out := make(chan *message.Message)
	go s.forward(in, out)
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

func (s *DrainingSubscriber) forward(in <-chan *message.Message, out chan<- *message.Message) {
	defer s.forwarders.Done()
	defer close(out)
	for {
		select {
		case <-s.closing:
			return
		case msg, ok := <-in:
			if !ok {
				return
			}
			if !s.track(&s.inflight) {
				msg.Nack() // not handed out: back to the broker, unprocessed
				return
			}
			go func() {
				defer s.inflight.Done()
				select {
				case <-msg.Acked():
				case <-msg.Nacked():
				}
			}()
			select {
			case out <- msg:
			case <-s.closing:
				msg.Nack()
				return
			}
		}
	}
}

// Draining returns a channel closed once Close has begun: handlers still
// running then will finish before the inner subscriber closes.
func (s *DrainingSubscriber) Draining() <-chan struct{} { return s.closing }

// Close stops handing out messages, waits (at most the drain timeout) until
// every message already handed out is acked or nacked, then closes the inner
// subscriber. It returns the inner Close error, joined with a timeout error
// if the drain did not finish. Later calls return the same result.
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
		s.closeErr = errors.Join(drainErr, s.inner.Close())
		s.mu.Lock()
		for _, cancel := range s.cancels {
			cancel()
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
