package middleware

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// TracingConfig configures Tracing. Zero values take the defaults.
type TracingConfig struct {
	// TracerProvider makes the tracer. Default otel.GetTracerProvider()
	// (a no-op until the application installs an SDK).
	TracerProvider trace.TracerProvider
	// Propagator reads and writes the trace context in message metadata
	// (AMQP headers). Default otel.GetTextMapPropagator(); when that is
	// the empty default, W3C trace context + baggage.
	Propagator propagation.TextMapPropagator
	// System is messaging.system. Default "rabbitmq".
	System string
	// QueueName names the consumed queue. Default the router's subscribe topic.
	QueueName func(ctx context.Context) string
	// MaxAttempts is recorded as rabbitretry.retry.max_attempts when > 0 (router.New
	// passes its own).
	MaxAttempts int
}

// Tracing makes one CONSUMER span per handler attempt, following the
// OpenTelemetry messaging semantic conventions (v1.37+, "Messaging spans"
// and "RabbitMQ"): name "process <destination>", messaging.system,
// messaging.operation.{type,name} = process, messaging.destination.name
// ("<exchange>:<routing key>:<queue>", empty parts dropped, a routing key
// equal to the queue collapsed), messaging.rabbitmq.destination.routing_key,
// messaging.message.id, messaging.message.conversation_id (correlation id),
// error.type and an Error status on failure; plus rabbitretry.retry.attempt,
// .max_attempts, .outcome, .error_class and .delay_ms (docs/tracing.md).
//
// One trace per message: the span is a child of the creation context the
// message carries (traceparent/tracestate, written by an instrumented
// producer) and links to it, as the conventions recommend. A message that
// arrives without one gets the first attempt's span context written into its
// metadata, so every retry copy and the poison copy carry it, unchanged, and
// all attempts join one trace. Each copy also carries rabbitretry-trace-prev, the
// attempt that made it, which the next attempt's span links to. Retries and
// the poison forward are span events (as Observer, combined by router.New).
//
// It needs only the OpenTelemetry API: with no SDK installed (or a span not
// sampled) the span is not recording and the middleware does nothing but
// carry the creation context. Attributes and links are set after the span
// starts, so a sampler sees only the parent, the kind and the name "process".
type Tracing struct {
	tracer     trace.Tracer
	prop       propagation.TextMapPropagator
	system     string
	queue      func(ctx context.Context) string
	maxAttempt int
	fields     []string // the propagator's header names
}

// NewTracing returns a Tracing.
func NewTracing(cfg TracingConfig) *Tracing {
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	prop := cfg.Propagator
	if prop == nil {
		prop = otel.GetTextMapPropagator()
		if len(prop.Fields()) == 0 {
			prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
		}
	}
	if cfg.System == "" {
		cfg.System = "rabbitmq"
	}
	if cfg.QueueName == nil {
		cfg.QueueName = message.SubscribeTopicFromCtx
	}
	return &Tracing{
		tracer: tp.Tracer(retrymeta.TracingScope), prop: prop, system: cfg.System,
		queue: cfg.QueueName, maxAttempt: cfg.MaxAttempts, fields: prop.Fields(),
	}
}

// metadataCarrier adapts message.Metadata to propagation.TextMapCarrier.
type metadataCarrier message.Metadata

func (c metadataCarrier) Get(key string) string { return message.Metadata(c).Get(key) }
func (c metadataCarrier) Set(key, value string) { message.Metadata(c).Set(key, value) }
func (c metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// Middleware wraps h in the attempt's span. Put it outermost (router.New
// does), so the span covers the retry or poison publish.
func (tr *Tracing) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		carrier := metadataCarrier(msg.Metadata)
		var creation trace.SpanContext
		if tr.carries(msg.Metadata) {
			creation = trace.SpanContextFromContext(tr.prop.Extract(context.Background(), carrier))
		}
		parent := ctx
		if creation.IsValid() {
			parent = trace.ContextWithRemoteSpanContext(ctx, creation)
		}
		spanCtx, span := tr.tracer.Start(parent, "process", consumerKind...)
		if !creation.IsValid() && span.SpanContext().IsValid() {
			// The first attempt's context becomes the message's creation
			// context for every copy.
			tr.prop.Inject(spanCtx, carrier)
		}
		if !span.IsRecording() {
			// No SDK, or not sampled: nothing to record. The creation
			// context travels in the metadata all the same.
			span.End()
			return h(msg)
		}
		defer span.End()
		span.SetName("process " + tr.destination(msg))
		span.SetAttributes(tr.attributes(msg)...)
		if creation.IsValid() {
			span.AddLink(trace.Link{SpanContext: creation})
		}
		if prevTP := msg.Metadata.Get(retrymeta.TracePrevKey); prevTP != "" {
			prev := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(),
				propagation.MapCarrier{"traceparent": prevTP}))
			if prev.IsValid() {
				span.AddLink(trace.Link{SpanContext: prev,
					Attributes: []attribute.KeyValue{attribute.String("rabbitretry.link", "previous_attempt")}})
			}
		}
		tp := propagation.MapCarrier{}
		propagation.TraceContext{}.Inject(spanCtx, tp)
		msg.Metadata.Set(retrymeta.TracePrevKey, tp["traceparent"])
		st := &attemptTrace{}
		msg.SetContext(context.WithValue(trace.ContextWithSpan(ctx, span), attemptTraceKey{}, st))
		out, err := h(msg)
		span.SetAttributes(attribute.Int(retrymeta.AttrAttempt, Attempt(msg)))
		outcome := st.outcome
		if err != nil {
			span.SetStatus(codes.Error, err.Error())
			span.SetAttributes(attribute.String("error.type", errorType(err)))
			if c := classificationOf(err); c.Class != "" && st.class == "" {
				st.class = c.Class
			}
			if outcome == "" {
				outcome = outcomeOf(err)
			}
		}
		if outcome == "" {
			outcome = "ack"
		}
		if err == nil && (outcome == "retry_scheduled" || outcome == "poisoned") {
			// The handler failed; the chain settled it (acked after the
			// copy was confirmed).
			span.SetStatus(codes.Error, "handler failed: "+outcome)
		}
		span.SetAttributes(attribute.String(retrymeta.AttrOutcome, outcome))
		if st.class != "" {
			span.SetAttributes(attribute.String(retrymeta.AttrErrorClass, st.class))
		}
		return out, err
	}
}

// consumerKind is the one start option, made once.
var consumerKind = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}

// carries reports whether md holds any of the propagator's fields (a cheap
// check that spares the extraction on untraced messages).
func (tr *Tracing) carries(md message.Metadata) bool {
	for _, f := range tr.fields {
		if _, ok := md[f]; ok {
			return true
		}
	}
	return false
}

// attemptTrace is what the Observer learnt during one attempt.
type attemptTrace struct {
	outcome, class string
}

type attemptTraceKey struct{}

func (tr *Tracing) attributes(msg *message.Message) []attribute.KeyValue {
	md := msg.Metadata
	attrs := []attribute.KeyValue{
		attribute.String("messaging.system", tr.system),
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.operation.name", "process"),
		attribute.String("messaging.destination.name", tr.destination(msg)),
		attribute.String("messaging.message.id", messageID(msg)),
	}
	if _, rk := deliveredVia(msg); rk != "" {
		attrs = append(attrs, attribute.String("messaging.rabbitmq.destination.routing_key", rk))
	}
	if cid := md.Get(retrymeta.PropCorrelationIDKey); cid != "" {
		attrs = append(attrs, attribute.String("messaging.message.conversation_id", cid))
	}
	if tr.maxAttempt > 0 {
		attrs = append(attrs, attribute.Int(retrymeta.AttrMaxAttempts, tr.maxAttempt))
	}
	return attrs
}

// deliveredVia returns the exchange and routing key of the delivery, or,
// for one that came back through the library's retry path, those the
// message was first consumed with.
func deliveredVia(msg *message.Message) (exchange, routingKey string) {
	md := msg.Metadata
	if md.Get(retrymeta.DeliveryRetryPathKey) != "" {
		if ex, rk := md.Get(OriginalExchangeKey), md.Get(OriginalRoutingKeyKey); ex != "" || rk != "" {
			return ex, rk
		}
	}
	return md.Get(retrymeta.DeliveryExchangeKey), md.Get(retrymeta.DeliveryRoutingKeyKey)
}

func messageID(msg *message.Message) string {
	if id := msg.Metadata.Get(retrymeta.PropMessageIDKey); id != "" {
		return id
	}
	return msg.UUID
}

// destination is "<exchange>:<routing key>:<queue>" without empty parts and
// with a routing key equal to the queue collapsed (semantic conventions,
// "RabbitMQ"). A delivery that came back through the retry path names the
// exchange and routing key the message was first consumed from, so every
// attempt of a message has the same destination.
func (tr *Tracing) destination(msg *message.Message) string {
	ex, rk := deliveredVia(msg)
	q := tr.queue(msg.Context())
	if rk == q {
		rk = ""
	}
	parts := make([]string, 0, 3)
	for _, p := range []string{ex, rk, q} {
		if p != "" {
			parts = append(parts, p)
		}
	}
	if len(parts) == 0 {
		return "unknown"
	}
	return strings.Join(parts, ":")
}

// errorType is a low-cardinality name for err: the innermost error's Go
// type, or "_OTHER" for plain errors.New values.
func errorType(err error) string {
	for {
		var next error
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			next = u.Unwrap()
		case interface{ Unwrap() []error }:
			if es := u.Unwrap(); len(es) > 0 {
				next = es[len(es)-1]
			}
		}
		if next == nil {
			break
		}
		err = next
	}
	t := reflect.TypeOf(err)
	if t == nil {
		return "_OTHER"
	}
	s := t.String()
	if s == "*errors.errorString" {
		return "_OTHER"
	}
	return s
}

func outcomeOf(err error) string {
	var dl *chainerr.DeadLetterRetryError
	var ex *chainerr.ExhaustedError
	var se *chainerr.ScheduleError
	switch {
	case errors.As(err, &dl):
		return "retry_scheduled"
	case errors.As(err, &ex):
		return "poisoned"
	case errors.As(err, &se):
		return "nack"
	}
	switch classificationOf(err).Action {
	case ActionPoison:
		return "poisoned"
	default:
		return "nack"
	}
}

// Observer returns an Observer that records retries, poisonings and drops
// as span events on the attempt's span (found in the message's context).
func (tr *Tracing) Observer() Observer { return tracingObserver{} }

type tracingObserver struct{}

func markOutcome(msg *message.Message, outcome, class string, attrs ...attribute.KeyValue) {
	ctx := msg.Context()
	if st, ok := ctx.Value(attemptTraceKey{}).(*attemptTrace); ok {
		st.outcome = outcome
		if class != "" {
			st.class = class
		}
	}
	trace.SpanFromContext(ctx).AddEvent("rabbitretry."+outcome, trace.WithAttributes(attrs...))
}

func (tracingObserver) RetryScheduled(msg *message.Message, attempt int, delay, took time.Duration) {
	markOutcome(msg, "retry_scheduled", msg.Metadata.Get(ErrorClassKey), attribute.Int(retrymeta.AttrAttempt, attempt),
		attribute.Int64(retrymeta.AttrDelayMs, delay.Milliseconds()), attribute.Int64("rabbitretry.retry.confirm_ms", took.Milliseconds()))
	trace.SpanFromContext(msg.Context()).SetAttributes(attribute.Int64(retrymeta.AttrDelayMs, delay.Milliseconds()))
}

func (tracingObserver) RetryFailed(msg *message.Message, attempt int, err error) {
	trace.SpanFromContext(msg.Context()).AddEvent("rabbitretry.retry_failed",
		trace.WithAttributes(attribute.Int(retrymeta.AttrAttempt, attempt), attribute.String("error.type", errorType(err))))
}

func (tracingObserver) Poisoned(msg *message.Message, attempt int, class string) {
	markOutcome(msg, "poisoned", class, attribute.Int(retrymeta.AttrAttempt, attempt), attribute.String(retrymeta.AttrErrorClass, class))
}

func (tracingObserver) PoisonFailed(msg *message.Message, attempt int, err error) {
	trace.SpanFromContext(msg.Context()).AddEvent("rabbitretry.poison_failed",
		trace.WithAttributes(attribute.Int(retrymeta.AttrAttempt, attempt), attribute.String("error.type", errorType(err))))
}

func (tracingObserver) Dropped(msg *message.Message, attempt int) {
	markOutcome(msg, "dropped", "", attribute.Int(retrymeta.AttrAttempt, attempt))
}
