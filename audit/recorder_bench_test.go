package audit

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// benchChain is the retry chain's success path around a no-op handler,
// with or without the Recorder's two middlewares (records published to a
// sink that discards them after JSON encoding).
func benchChain(b *testing.B, withRecorder bool) {
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	mem, _ := middleware.NewMemoryDelayer(ps, nil, nil)
	var rec *Recorder
	cfg := router.Config{Delayer: mem, PoisonPublisher: gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})}
	if withRecorder {
		rcfg := RecorderConfig{URI: "amqp://unused/"}
		rcfg.setDefaults()
		rec = newRecorder(rcfg)
		rec.send = func(context.Context, []amqp.Publishing) error { return nil }
		rec.start()
		defer rec.Close(context.Background())
		cfg.Observer = rec.Observer()
	}
	chain, err := router.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	h := message.HandlerFunc(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if withRecorder {
		h = rec.Middleware(chain.Middleware(rec.HandlerMiddleware(h)))
	} else {
		h = chain.Middleware(h)
	}
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		msg := message.NewMessage("5b1f3c1e-6f1d-4a57-9f0e-2d7d0c1a9b11", nil)
		msg.SetContext(ctx)
		if _, err := h(msg); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if rec != nil {
		if err := rec.Close(context.Background()); err != nil {
			b.Fatal(err)
		}
		if st := rec.Stats(); st.Published != st.Recorded {
			b.Fatalf("stats %+v", st)
		}
	}
}

// BenchmarkChainSuccess is the chain alone, for comparison.
func BenchmarkChainSuccess(b *testing.B) { benchChain(b, false) }

// BenchmarkRecorderMiddleware is the chain with the Recorder: the
// difference is the recording call's cost on the handler goroutine (the
// background publisher's JSON encoding runs on its own goroutine, but on
// the same CPUs).
func BenchmarkRecorderMiddleware(b *testing.B) { benchChain(b, true) }

// BenchmarkRecordingCall is the Recorder's two middlewares alone around a
// no-op handler, with no background publisher running (records stay in a
// buffer of b.N): the pure cost of the recording call on the handler
// goroutine.
func BenchmarkRecordingCall(b *testing.B) {
	rcfg := RecorderConfig{URI: "amqp://unused/", Buffer: b.N + 1}
	rcfg.setDefaults()
	rec := newRecorder(rcfg)
	h := rec.Middleware(rec.HandlerMiddleware(func(*message.Message) ([]*message.Message, error) { return nil, nil }))
	ctx := context.Background()
	msgs := make([]*message.Message, b.N)
	for i := range msgs {
		msgs[i] = message.NewMessage("5b1f3c1e-6f1d-4a57-9f0e-2d7d0c1a9b11", nil)
		msgs[i].SetContext(ctx)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := h(msgs[i]); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if st := rec.Stats(); st.Recorded != uint64(b.N) || st.Buffered != b.N {
		b.Fatalf("stats %+v", st)
	}
}
