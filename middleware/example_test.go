package middleware_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// A handler says what a failure means by wrapping its error; the Classifier
// turns that into the chain's action. Unmarked errors are transient and
// retried with backoff.
func ExampleClassifier_Classify() {
	for _, err := range []error{
		errors.New("connection reset"),
		middleware.Permanent(errors.New("unknown customer")),
		middleware.RetryAfter(errors.New("429 Too Many Requests"), 30*time.Second),
		middleware.Drop(errors.New("duplicate order")),
	} {
		c := middleware.DefaultClassifier.Classify(err)
		fmt.Printf("%-22s -> %s (%s) delay=%v\n", err, c.Action, c.Class, c.Delay)
	}
	// Output:
	// connection reset       -> retry (transient) delay=0s
	// unknown customer       -> poison (permanent) delay=0s
	// 429 Too Many Requests (retry after 30s) -> retry (retry-after) delay=30s
	// duplicate order        -> drop (dropped) delay=0s
}

// Rules match errors the handler does not mark itself: here a missing row
// and a malformed payload are poisoned at once. DefaultRules (Permanent,
// Drop, RetryAfter, ...) still apply after them.
func ExampleNewClassifier() {
	c, err := middleware.NewClassifier(middleware.ClassifierConfig{
		Rules: []middleware.Rule{
			{Class: "not-found", Match: middleware.MatchIs(sql.ErrNoRows), Action: middleware.ActionPoison},
			{Class: middleware.ClassMalformed, Match: middleware.MatchAs[*json.SyntaxError](), Action: middleware.ActionPoison},
		},
	})
	if err != nil {
		panic(err)
	}
	var v map[string]any
	for _, err := range []error{
		fmt.Errorf("load order 42: %w", sql.ErrNoRows),
		json.Unmarshal([]byte("{"), &v),
		errors.New("timeout"),
	} {
		fmt.Println(c.Classify(err).Action, c.Classify(err).Class)
	}
	// Output:
	// poison not-found
	// poison malformed
	// retry transient
}

// RetryAfter asks for the next attempt no earlier than d (e.g. from an HTTP
// Retry-After header); the wrapped error stays visible to errors.Is.
func ExampleRetryAfter() {
	errRateLimited := errors.New("rate limited")
	err := middleware.RetryAfter(fmt.Errorf("charge card: %w", errRateLimited), 2*time.Minute)

	c := middleware.DefaultClassifier.Classify(err)
	fmt.Println(c.Delay, c.Action == middleware.ActionRetry, errors.Is(err, errRateLimited))
	fmt.Println(middleware.RetryAfter(nil, time.Minute) == nil)
	// Output:
	// 2m0s true true
	// true
}

// Permanent marks an error no retry can fix: the message is poisoned after
// this attempt.
func ExamplePermanent() {
	errUnknown := errors.New("unknown customer")
	err := middleware.Permanent(fmt.Errorf("order 7: %w", errUnknown))
	fmt.Println(err, middleware.IsPermanent(err), errors.Is(err, errUnknown))
	fmt.Println(middleware.Permanent(nil) == nil)
	// Output:
	// order 7: unknown customer true true
	// true
}

// DependencyUnavailable marks a failure caused by a dependency that is down,
// not by the message: with a Pause in the chain it pauses consumption
// instead of charging an attempt.
func ExampleDependencyUnavailable() {
	errDown := errors.New("dial tcp 10.0.0.5:5432: connection refused")
	err := middleware.DependencyUnavailable(errDown)
	fmt.Println(middleware.IsDependencyOutage(err), errors.Is(err, errDown))
	fmt.Println(middleware.IsDependencyOutage(errors.New("bad payload")))
	// Output:
	// true true
	// false
}

// A MemoryDelayer holds retry copies in process and publishes them back
// after their delay: the Delayer for gochannel and broker-free tests (not
// durable).
func ExampleNewMemoryDelayer() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	in, err := pubSub.Subscribe(context.Background(), "orders")
	if err != nil {
		panic(err)
	}
	// nil topic: the copy goes back to the topic the handler consumes
	// (message.SubscribeTopicFromCtx); this example has no router, so name it.
	d, err := middleware.NewMemoryDelayer(pubSub, func(context.Context) string { return "orders" }, nil)
	if err != nil {
		panic(err)
	}
	defer d.Close()

	start := time.Now()
	if err := d.Schedule(context.Background(), message.NewMessage("order-1", []byte("{}")), 50*time.Millisecond); err != nil {
		panic(err)
	}
	fmt.Println("pending:", d.Pending())
	msg := <-in
	msg.Ack()
	fmt.Println("back:", msg.UUID, time.Since(start) >= 50*time.Millisecond)
	// Output:
	// pending: 1
	// back: order-1 true
}

// printObserver prints what the chain did with each failed message.
type printObserver struct{ middleware.NopObserver }

func (printObserver) Poisoned(msg *message.Message, attempt int, class string) {
	fmt.Printf("poisoned %s after attempt %d (%s)\n", msg.UUID, attempt, class)
}

// Observers combines observers (metrics, tracing, your own); embed
// NopObserver to implement only the events you need.
func ExampleObservers() {
	obs := middleware.Observers(printObserver{}, nil, middleware.NopObserver{})
	msg := message.NewMessage("order-9", nil)
	obs.RetryScheduled(msg, 1, time.Second, time.Millisecond) // printObserver ignores it
	obs.Poisoned(msg, 5, middleware.ClassExhausted)
	// Output:
	// poisoned order-9 after attempt 5 (exhausted)
}

// The PoisonForwarder publishes a message whose error is permanent (or
// whose retries are exhausted) to the poison topic with the failure
// metadata, and acks the original only once that publish returned.
func ExampleNewPoisonForwarder() {
	// Persistent: a plain GoChannel drops messages nobody subscribed to yet.
	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer poison.Close()
	fwd, err := middleware.NewPoisonForwarder(middleware.PoisonForwarderConfig{
		Publisher: poison,
		QueueName: func(context.Context) string { return "orders" },
	})
	if err != nil {
		panic(err)
	}
	handler := fwd.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, middleware.Permanent(errors.New("unknown customer"))
	})
	if _, err := handler(message.NewMessage("order-3", []byte("{}"))); err != nil {
		panic(err) // nil: the message is in the poison topic, ack the original
	}

	ch, err := poison.Subscribe(context.Background(), "poison")
	if err != nil {
		panic(err)
	}
	p := <-ch
	p.Ack()
	for _, k := range []string{wmw.ReasonForPoisonedKey, middleware.ErrorClassKey, middleware.PoisonAttemptsKey, middleware.OriginalQueueKey} {
		fmt.Printf("%s=%s\n", k, p.Metadata.Get(k))
	}
	// Output:
	// reason_poisoned=unknown customer
	// rabbitretry-error-class=permanent
	// rabbitretry-attempts=1
	// rabbitretry-original-queue=orders
}

// Tracing makes one span per attempt; give it your TracerProvider (here an
// in-memory recorder).
func ExampleNewTracing() {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())

	tr := middleware.NewTracing(middleware.TracingConfig{
		TracerProvider: tp,
		QueueName:      func(context.Context) string { return "orders" },
		MaxAttempts:    5,
	})
	h := tr.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if _, err := h(message.NewMessage("order-5", nil)); err != nil {
		panic(err)
	}
	for _, s := range spans.Ended() {
		fmt.Println(s.Name(), s.SpanKind())
		for _, a := range s.Attributes() {
			if a.Key == "rabbitretry.retry.attempt" || a.Key == "rabbitretry.retry.outcome" {
				fmt.Println(" ", a.Key, a.Value.String())
			}
		}
	}
	// Output:
	// process orders consumer
	//   rabbitretry.retry.attempt 1
	//   rabbitretry.retry.outcome ack
}
