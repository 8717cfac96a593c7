package router_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// Cancelling Router.Run's context (Watermill's usual stop) stops a router
// whose handlers consume a DrainingSubscriber: the handler in flight
// finishes with a live context and Run returns right after it; then the
// subscriber is closed. Before, Run never returned.
func TestDrainingSubscriberStopsWithRunContext(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	sub := router.NewDrainingSubscriber(pubsub, 5*time.Second)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	var ctxErr error
	var runs atomic.Int32
	r.AddConsumerHandler("h", "t", sub, func(msg *message.Message) error {
		runs.Add(1)
		close(entered)
		<-release
		ctxErr = msg.Context().Err()
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	recv(t, r.Running(), 5*time.Second)
	if err := pubsub.Publish("t", message.NewMessage("m1", nil)); err != nil {
		t.Fatal(err)
	}
	recv(t, entered, 5*time.Second)
	cancel()
	recv(t, sub.Draining(), 5*time.Second)
	select {
	case err := <-ran:
		t.Fatalf("Run returned (%v) while a handler was still running", err)
	default:
	}
	close(release)
	if err := recv(t, ran, 5*time.Second); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if ctxErr != nil || runs.Load() != 1 {
		t.Fatalf("handler saw context error %v, ran %d times", ctxErr, runs.Load())
	}
	if err := sub.Close(); err != nil {
		t.Fatalf("Close after the stop: %v", err)
	}
	if _, err := sub.Subscribe(context.Background(), "t"); !errors.Is(err, middleware.ErrClosed) {
		t.Fatalf("Subscribe after the stop: %v, want middleware.ErrClosed", err)
	}
}

// Handler.Stop of one of two handlers sharing a DrainingSubscriber stops
// that handler only: the other keeps receiving, and the subscriber stays
// open.
func TestDrainingSubscriberHandlerStop(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	sub := router.NewDrainingSubscriber(pubsub, 5*time.Second)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 10)
	h1 := r.AddConsumerHandler("h1", "t1", sub, func(msg *message.Message) error { got <- "t1"; return nil })
	r.AddConsumerHandler("h2", "t2", sub, func(msg *message.Message) error { got <- "t2"; return nil })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	recv(t, r.Running(), 5*time.Second)
	h1.Stop()
	recv(t, h1.Stopped(), 5*time.Second)
	select {
	case <-sub.Draining():
		t.Fatal("stopping one handler closed the shared subscriber")
	default:
	}
	if err := pubsub.Publish("t2", message.NewMessage("m2", nil)); err != nil {
		t.Fatal(err)
	}
	if g := recv(t, got, 5*time.Second); g != "t2" {
		t.Fatalf("got %s", g)
	}
	cancel()
	if err := recv(t, ran, 5*time.Second); err != nil {
		t.Fatalf("Run: %v", err)
	}
	recv(t, sub.Draining(), 5*time.Second)
}

// The router and the poison copy name a DrainingSubscriber by the
// subscriber it wraps (issue #20 item 8: logs said
// "router.DrainingSubscriber").
func TestDrainingSubscriberNamedByInner(t *testing.T) {
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubsub.Close()
	sub := router.NewDrainingSubscriber(pubsub, time.Second)
	if got := fmt.Sprint(sub); got != "gochannel.GoChannel" {
		t.Errorf("DrainingSubscriber named %q, want gochannel.GoChannel", got)
	}

	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer poison.Close()
	chain, err := router.New(router.Config{Delayer: &fakeDelayer{}, PoisonPublisher: poison})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	chain.AddTo(r)
	r.AddConsumerHandler("h", "in", sub, func(*message.Message) error {
		return middleware.Permanent(errors.New("bad"))
	})
	go func() { _ = r.Run(context.Background()) }()
	defer r.Close()
	<-r.Running()
	ch, err := poison.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	if err := pubsub.Publish("in", message.NewMessage("m1", nil)); err != nil {
		t.Fatal(err)
	}
	p := recv(t, ch, 5*time.Second)
	p.Ack()
	if got := p.Metadata.Get("subscriber_poisoned"); got != "gochannel.GoChannel" {
		t.Errorf("subscriber_poisoned = %q, want gochannel.GoChannel", got)
	}
	t.Logf("ACCOUNT published=1 handled=0 poisoned=1 duplicates=0 lost=0")
}

// slowAckInner is an inner subscriber whose goroutine sends a message's
// ack some time after the router acked it (as watermill-amqp's does, from
// its own goroutine), then ends the message's context.
type slowAckInner struct {
	out       chan *message.Message
	ackSeen   chan struct{} // closed when its goroutine saw the router's ack
	release   chan struct{} // the test lets it "send" the ack
	mu        sync.Mutex
	events    []string // "wire-ack", "close", in order
	innerDone chan struct{}
}

func (f *slowAckInner) SettledContexts() {}

func (f *slowAckInner) record(e string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, e)
}

func (f *slowAckInner) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	msg := message.NewMessage(watermill.NewUUID(), nil)
	mctx, cancel := context.WithCancel(ctx)
	msg.SetContext(mctx)
	go func() {
		defer close(f.innerDone)
		f.out <- msg
		<-msg.Acked()
		close(f.ackSeen)
		<-f.release
		f.record("wire-ack")
		cancel()
	}()
	return f.out, nil
}

func (f *slowAckInner) Close() error {
	f.record("close")
	return nil
}

// TestDrainClosesInnerAfterItsAcksAreSent: Close must not close the inner
// subscriber while its goroutine has not yet sent the ack of a message the
// router acked (watermill-amqp v2 would nack it: a success run twice),
// however slow that goroutine is (here: held for several times the old
// 100 ms grace).
func TestDrainClosesInnerAfterItsAcksAreSent(t *testing.T) {
	inner := &slowAckInner{out: make(chan *message.Message), ackSeen: make(chan struct{}), release: make(chan struct{}), innerDone: make(chan struct{})}
	s := router.NewDrainingSubscriber(inner, 10*time.Second)
	ch, err := s.Subscribe(context.Background(), "t")
	if err != nil {
		t.Fatal(err)
	}
	msg := <-ch
	msg.Ack() // the router's ack
	<-inner.ackSeen
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	// Fault injection, not synchronisation: the inner goroutine is slow to
	// send its ack.
	held := time.NewTimer(500 * time.Millisecond)
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) before the inner subscriber sent its ack", err)
	case <-held.C:
	}
	inner.mu.Lock()
	early := slices.Contains(inner.events, "close")
	inner.mu.Unlock()
	if early {
		t.Fatal("the inner subscriber was closed before it sent the ack of a message the router acked")
	}
	close(inner.release)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	<-inner.innerDone
	inner.mu.Lock()
	defer inner.mu.Unlock()
	if !slices.Equal(inner.events, []string{"wire-ack", "close"}) {
		t.Fatalf("events %v, want the ack sent before the close", inner.events)
	}
}
