package router_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

func benchChain(b *testing.B, d middleware.Delayer) *router.Chain {
	b.Helper()
	c, err := router.New(router.Config{Delayer: d, PoisonPublisher: nopPublisher{}, Policy: router.Policy{MaxAttempts: 5}})
	if err != nil {
		b.Fatal(err)
	}
	return c
}

func noop(*message.Message) ([]*message.Message, error) { return nil, nil }

// BenchmarkBareHandler is the baseline: the no-op handler alone.
func BenchmarkBareHandler(b *testing.B) {
	msg := message.NewMessage("bench", []byte(`{"id":1}`))
	h := message.HandlerFunc(noop)
	b.ReportAllocs()
	for b.Loop() {
		msg.SetContext(context.Background()) // same per-iteration work as the chain benchmarks
		if _, err := h(msg); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkChainSuccess is the per-message cost of the whole chain around a
// no-op handler that succeeds, on a first delivery.
func BenchmarkChainSuccess(b *testing.B) {
	h := benchChain(b, &fakeDelayer{}).Middleware(noop)
	msg := message.NewMessage("bench", []byte(`{"id":1}`))
	b.ReportAllocs()
	for b.Loop() {
		// Reset the context: the counter wraps it, and a context chain
		// growing across iterations would skew the result.
		msg.SetContext(context.Background())
		if _, err := h(msg); err != nil {
			b.Fatal(err)
		}
	}
}

// nilDelayer accepts every retry at once.
type nilDelayer struct{}

func (nilDelayer) Schedule(context.Context, *message.Message, time.Duration) error { return nil }

// BenchmarkChainRetry is the cost of a failed first attempt: classification,
// backoff, building the retry copy and handing it to a Delayer that returns
// nil at once.
func BenchmarkChainRetry(b *testing.B) {
	errFail := errors.New("downstream unavailable")
	h := benchChain(b, nilDelayer{}).Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errFail
	})
	msg := message.NewMessage("bench", []byte(`{"id":1}`))
	msg.Metadata.Set("trace-id", "0123456789abcdef")
	b.ReportAllocs()
	for b.Loop() {
		msg.SetContext(context.Background())
		if _, err := h(msg); err != nil {
			b.Fatal(err)
		}
	}
}

// runOnFreshGoroutines calls h once per iteration on a new goroutine, as
// Watermill's router does per message, so that stack growth caused by the
// chain's frames shows up in the figure.
func runOnFreshGoroutines(b *testing.B, h message.HandlerFunc) {
	msg := message.NewMessage("bench", []byte(`{"id":1}`))
	done := make(chan struct{})
	b.ReportAllocs()
	for b.Loop() {
		msg.SetContext(context.Background())
		go func() {
			_, _ = h(msg)
			done <- struct{}{}
		}()
		<-done
	}
}

// BenchmarkBareHandlerGoroutine: the no-op handler on a fresh goroutine.
func BenchmarkBareHandlerGoroutine(b *testing.B) { runOnFreshGoroutines(b, noop) }

// BenchmarkChainSuccessGoroutine: the chain around the no-op handler on a
// fresh goroutine per message.
func BenchmarkChainSuccessGoroutine(b *testing.B) {
	runOnFreshGoroutines(b, benchChain(b, &fakeDelayer{}).Middleware(noop))
}
