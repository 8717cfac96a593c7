package amqpretry_test

import (
	"context"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

// memSubscriber hands the router messages unmarshaled from prepared
// deliveries, one at a time (like prefetch 1: the next one only once the
// previous is acked), so a benchmark measures the client-side cost of the
// healthy path (Marshaler.Unmarshal, the router, the retry chain) without a
// broker round trip per message.
type memSubscriber struct {
	unmarshal func(amqp.Delivery) (*message.Message, error)
	mk        func(i int) amqp.Delivery
	n         int
	done      chan struct{}
}

func (s *memSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		defer close(s.done)
		for i := range s.n {
			msg, err := s.unmarshal(s.mk(i))
			if err != nil {
				panic(err)
			}
			msgCtx, cancel := context.WithCancel(ctx)
			msg.SetContext(msgCtx)
			select {
			case out <- msg:
			case <-ctx.Done():
				cancel()
				return
			}
			select {
			case <-msg.Acked():
			case <-msg.Nacked():
				panic("nacked on the healthy path")
			case <-ctx.Done():
				cancel()
				return
			}
			cancel()
		}
	}()
	return out, nil
}

func (s *memSubscriber) Close() error { return nil }

// BenchmarkHealthyPath: the no-failure path of a Retry's chain behind a
// message.Router, one message at a time, with deliveries shaped like the
// bench's (a UUID and one string header, persistent, ~200 bytes of body) and
// acknowledged by a real AMQP channel (so that the delivery tracking is
// exercised). The broker is only used to build the Retry and the channel.
// Written against the public API only, so it runs unchanged on older
// commits for before/after comparisons.
func BenchmarkHealthyPath(b *testing.B) {
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp.Dial(uri)
	if err != nil {
		b.Skipf("no broker at %s: %v", uri, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	defer ch.Close()
	logger := watermill.NopLogger{}
	r, err := amqpretry.New(amqpretry.Config{Subscriber: wamqp.NewDurableQueueConfig(uri), Logger: logger})
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	const q = "bench-healthy"
	body := []byte(`{"id":1,"pad":"` + string(make([]byte, 180)) + `"}`)
	uuids := make([]string, 1024)
	for i := range uuids {
		uuids[i] = watermill.NewUUID()
	}
	mk := func(i int) amqp.Delivery {
		return amqp.Delivery{
			Acknowledger: ch,
			Headers:      amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: uuids[i%len(uuids)], "bench-index": strconv.Itoa(i)},
			DeliveryMode: amqp.Persistent,
			DeliveryTag:  uint64(i + 1),
			Exchange:     "",
			RoutingKey:   q,
			Body:         body,
		}
	}
	wr, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		b.Fatal(err)
	}
	handled := 0
	// The handler does what examples/bench's does per message (a time
	// stamp): a realistic light handler, a few frames deep.
	start := time.Now()
	var last time.Duration
	sub := &memSubscriber{unmarshal: r.SubscriberConfig().Marshaler.Unmarshal, mk: mk, n: b.N, done: make(chan struct{})}
	wr.AddConsumerHandler("bench", q, sub, func(*message.Message) error { handled++; last = time.Since(start); return nil })
	wr.AddMiddleware(r.Middleware)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := benchCPUTime()
	go func() { _ = wr.Run(ctx) }()
	<-sub.done
	cpu := benchCPUTime() - cpu0
	b.StopTimer()
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
	cancel()
	_ = wr.Close()
	_ = last
	if handled != b.N {
		b.Fatalf("handled %d of %d", handled, b.N)
	}
}

// benchCPUTime is this process's user+system CPU time: less sensitive than wall
// time to the other load on a shared machine.
func benchCPUTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
