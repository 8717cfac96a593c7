package amqpretry_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

func spanAttr(s sdktrace.ReadOnlySpan, key string) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// TestE2E_TracingOneTracePerMessage: with Tracing on, every attempt of a
// message is a CONSUMER span in the producer's trace (child of the creation
// context, linked to it and to the previous attempt), with the messaging
// semantic-convention attributes, the attempt number, the outcome and the
// delay; the poison forward is a span event. A message published without a
// trace context still has all its attempts in one trace.
func TestE2E_TracingOneTracePerMessage(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) {
		c.Tracing = &middleware.TracingConfig{TracerProvider: tp}
	})
	runs := newRecorder()
	q := e.handle("billing", func(msg *message.Message) error {
		runs.record(msg, middleware.Attempt(msg))
		switch string(msg.Payload) {
		case "flaky":
			if middleware.Attempt(msg) < 3 {
				return errors.New("gateway timeout")
			}
			return nil
		default:
			return errors.New("always fails")
		}
	})
	e.start()

	// An instrumented producer: its span context travels as traceparent.
	producerCtx, producer := tp.Tracer("producer").Start(context.Background(), "send orders", trace.WithSpanKind(trace.SpanKindProducer))
	flaky := message.NewMessage("flaky-1", []byte("flaky"))
	propagation.TraceContext{}.Inject(producerCtx, propagation.MapCarrier(flaky.Metadata))
	producer.End()
	bare := message.NewMessage("bare-1", []byte("doomed"))
	e.publish(flaky, bare)

	waitFor(t, 30*time.Second, "3 runs each", func() bool { return runs.count("flaky-1") == 3 && runs.count("bare-1") == 3 })
	waitFor(t, 30*time.Second, "poison copy", func() bool { return e.depth(e.retry.Topology().Naming().PoisonQueue(q)) == 1 })
	waitFor(t, 10*time.Second, "6 process spans", func() bool {
		n := 0
		for _, s := range rec.Ended() {
			if s.SpanKind() == trace.SpanKindConsumer {
				n++
			}
		}
		return n == 6
	})
	byMsg := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.SpanKind() != trace.SpanKindConsumer {
			continue
		}
		id, _ := spanAttr(s, "messaging.message.id")
		byMsg[id.AsString()] = append(byMsg[id.AsString()], s)
	}
	check := func(id string, wantTrace trace.TraceID, outcomes []string) {
		t.Helper()
		spans := byMsg[id]
		if len(spans) != 3 {
			t.Fatalf("%s: %d spans, want 3", id, len(spans))
		}
		for i, s := range spans {
			if wantTrace.IsValid() && s.SpanContext().TraceID() != wantTrace {
				t.Errorf("%s attempt %d: trace %s, want the producer's %s", id, i+1, s.SpanContext().TraceID(), wantTrace)
			}
			if s.SpanContext().TraceID() != spans[0].SpanContext().TraceID() {
				t.Errorf("%s attempt %d: not in the first attempt's trace", id, i+1)
			}
			for key, want := range map[string]string{
				"messaging.system": "rabbitmq", "messaging.operation.type": "process",
				"messaging.destination.name":                 e.exchange + ":order.created:" + q,
				"messaging.rabbitmq.destination.routing_key": "order.created",
				retrymeta.AttrOutcome:                        outcomes[i],
			} {
				if v, _ := spanAttr(s, key); v.AsString() != want {
					t.Errorf("%s attempt %d: %s = %q, want %q", id, i+1, key, v.AsString(), want)
				}
			}
			if v, _ := spanAttr(s, retrymeta.AttrAttempt); v.AsInt64() != int64(i+1) {
				t.Errorf("%s span %d: attempt %d", id, i+1, v.AsInt64())
			}
			if v, _ := spanAttr(s, retrymeta.AttrMaxAttempts); v.AsInt64() != 3 {
				t.Errorf("%s: max attempts %d, want 3", id, v.AsInt64())
			}
			if outcomes[i] == "retry_scheduled" {
				if _, ok := spanAttr(s, retrymeta.AttrDelayMs); !ok {
					t.Errorf("%s attempt %d: no delay attribute", id, i+1)
				}
			}
			if i > 0 {
				prev := spans[i-1].SpanContext().SpanID()
				linked := false
				for _, l := range s.Links() {
					linked = linked || l.SpanContext.SpanID() == prev
				}
				if !linked {
					t.Errorf("%s attempt %d: no link to attempt %d", id, i+1, i)
				}
			}
		}
		last := spans[2]
		if outcomes[2] == "poisoned" {
			found := false
			for _, ev := range last.Events() {
				found = found || ev.Name == "rabbitretry.poisoned"
			}
			if !found || last.Status().Code.String() != "Error" {
				t.Errorf("%s: poison span events %v status %v", id, last.Events(), last.Status())
			}
		}
	}
	// Ended spans are in end order; attempts end in order.
	check("flaky-1", producer.SpanContext().TraceID(), []string{"retry_scheduled", "retry_scheduled", "ack"})
	if p := byMsg["flaky-1"][0].Parent(); p.SpanID() != producer.SpanContext().SpanID() {
		t.Errorf("first attempt's parent %s, want the producer span %s", p.SpanID(), producer.SpanContext().SpanID())
	}
	check("bare-1", trace.TraceID{}, []string{"retry_scheduled", "retry_scheduled", "poisoned"})
	poisoned := e.drain(e.retry.Topology().Naming().PoisonQueue(q))
	if len(poisoned) != 1 || poisoned[0].Headers["traceparent"] == nil {
		t.Errorf("poison copy carries no traceparent: %v", poisoned)
	}
}
