package middleware_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// provenChain is the attempt counter with the router's default sources for
// queue "orders" (outside the native mode) in front of a Republisher.
func provenChain(t *testing.T, maxAttempts int, d middleware.Delayer, h message.HandlerFunc) message.HandlerFunc {
	t.Helper()
	qn := func(*message.Message) string { return "orders" }
	c := newCounter(t, middleware.HeaderSource(qn), amqpwire.XDeathSource(qn), amqpwire.NackCountSource())
	r := newRepublisher(t, middleware.RepublisherConfig{Delayer: d, MaxAttempts: maxAttempts})
	return c.Middleware(r.Middleware(h))
}

// nackedDelivery is a RabbitMQ 4.3 quorum-queue redelivery as the amqpretry
// Marshaler exposes it after `nacks` returns by basic.nack (requeue) that did
// not run the handler (e.g. a message the Pause held when the router stopped).
func nackedDelivery(nacks string) *message.Message {
	msg := newMsg("p")
	msg.Metadata.Set(retrymeta.DeliveryExchangeKey, "")
	msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
	msg.Metadata.Set(retrymeta.XAcquiredCountKey, nacks)
	msg.Metadata.Set(retrymeta.XDeliveryCountKey, "0")
	msg.SetContext(context.Background())
	return msg
}

// Issue #18 item 1: a message nacked back without a run (x-acquired-count 1)
// with MaxAttempts 1 was poisoned "past MaxAttempts, handler not run"
// although its handler never ran. It runs once, as attempt 1.
func TestUnprovenNacksDoNotPoisonWithoutRun(t *testing.T) {
	ran := 0
	var seen int
	h := provenChain(t, 1, &recordingDelayer{}, func(msg *message.Message) ([]*message.Message, error) {
		ran++
		seen = middleware.Attempt(msg)
		return nil, nil
	})
	if _, err := h(nackedDelivery("1")); err != nil || ran != 1 || seen != 1 {
		t.Fatalf("err %v, handler ran %d times (attempt %d), want nil, 1 run as attempt 1", err, ran, seen)
	}

	// Failing on that last attempt: exhausted (poisoned) after the run.
	ran = 0
	fail := errors.New("boom")
	h = provenChain(t, 2, &recordingDelayer{}, func(msg *message.Message) ([]*message.Message, error) {
		ran++
		seen = middleware.Attempt(msg)
		return nil, fail
	})
	_, err := h(nackedDelivery("5"))
	var ex *chainerr.ExhaustedError
	if !errors.As(err, &ex) || !errors.Is(err, fail) || ran != 1 || seen != 2 || ex.Attempts != 2 {
		t.Fatalf("err %v, ran %d as attempt %d: want exhausted by the handler's error after 1 run as attempt 2", err, ran, seen)
	}
}

// Proven runs still bound the count: a copy of this queue's chain whose
// proven attempt number is past MaxAttempts (a poison parked by the
// fallback) is poisoned without running, and a copy made after unproven
// nacks carries the proven number + 1.
func TestProvenAttemptCarriedOnCopies(t *testing.T) {
	d := &recordingDelayer{}
	fail := errors.New("boom")
	ran := 0
	h := provenChain(t, 3, d, func(*message.Message) ([]*message.Message, error) { ran++; return nil, fail })
	// Two nacks without a run: attempt 3 counted, 1 proven. The run fails:
	// exhausted (attempt 3 = MaxAttempts), not retried.
	if _, err := h(nackedDelivery("2")); !errors.As(err, new(*chainerr.ExhaustedError)) || ran != 1 {
		t.Fatalf("err %v after %d runs", err, ran)
	}
	// One nack: attempt 2 counted, 1 proven; the copy says attempt 3, proven 2.
	if _, err := h(nackedDelivery("1")); err != nil || len(d.Calls()) != 1 {
		t.Fatalf("err %v, %d copies", err, len(d.Calls()))
	}
	c := d.Calls()[0].msg
	if a, p := c.Metadata.Get(middleware.AttemptKey), c.Metadata.Get(retrymeta.ProvenAttemptKey); a != "3" || p != "2" {
		t.Fatalf("copy attempt %s proven %s, want 3 and 2", a, p)
	}

	// An own copy (gochannel: OriginalQueueKey) proven past MaxAttempts:
	// poisoned without running.
	ran = 0
	m := newMsg("p")
	m.Metadata.Set(middleware.OriginalQueueKey, "orders")
	m.Metadata.Set(middleware.AttemptKey, "4")
	m.Metadata.Set(retrymeta.ProvenAttemptKey, "4")
	if _, err := h(m); !errors.As(err, new(*chainerr.ExhaustedError)) || ran != 0 {
		t.Fatalf("err %v after %d runs, want exhausted without a run", err, ran)
	}
	// The same copy proven only to 2 (its count includes unproven nacks): runs.
	m = newMsg("p")
	m.Metadata.Set(middleware.OriginalQueueKey, "orders")
	m.Metadata.Set(middleware.AttemptKey, "4")
	m.Metadata.Set(retrymeta.ProvenAttemptKey, "2")
	if _, err := h(m); !errors.As(err, new(*chainerr.ExhaustedError)) || ran != 1 {
		t.Fatalf("err %v after %d runs, want exhausted after 1 run", err, ran)
	}
	// A copy without ProvenAttemptKey (made before it existed): all proven.
	ran = 0
	m = newMsg("p")
	m.Metadata.Set(middleware.OriginalQueueKey, "orders")
	m.Metadata.Set(middleware.AttemptKey, "4")
	if _, err := h(m); !errors.As(err, new(*chainerr.ExhaustedError)) || ran != 0 {
		t.Fatalf("err %v after %d runs, want exhausted without a run", err, ran)
	}
}
