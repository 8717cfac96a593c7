package amqpretry_test

import (
	"context"
	"maps"
	"slices"
	"testing"
	"unsafe"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// footprintQueue is the queue footprintRetry's delivery came from.
const footprintQueue = "rabbitretry-test.footprint"

// footprintRetry returns a Retry and an unmarshaled healthy delivery
// (two headers, persistent, not redelivered) as the router hands it to the
// chain.
func footprintRetry(t *testing.T) (*amqpretry.Retry, *message.Message) {
	t.Helper()
	uri := testkit.URI(t)
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	r, err := amqpretry.New(amqpretry.Config{Subscriber: wamqp.NewDurableQueueConfig(uri), Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	d := amqp.Delivery{Acknowledger: ch, DeliveryMode: amqp.Persistent, DeliveryTag: 1, RoutingKey: footprintQueue, Body: []byte("{}"),
		Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: watermill.NewUUID(), "app-a": "1", "app-b": "2"}}
	msg, err := r.SubscriberConfig().Marshaler.Unmarshal(d)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	msg.SetContext(ctx)
	return r, msg
}

// TestHealthyPathMetadataKeys: on the healthy path the chain adds one key
// to the handler's metadata, the attempt number. More would cost every
// message: Go keeps a map of up to 8 entries in one small group and
// grows it into a table (an allocation and a rehash, on the handler's
// goroutine) at the 9th, and a delivery's metadata already holds its
// headers plus the Marshaler's delivery keys (6 here).
func TestHealthyPathMetadataKeys(t *testing.T) {
	r, msg := footprintRetry(t)
	before := slices.Sorted(maps.Keys(msg.Metadata))
	var inHandler []string
	h := r.Middleware(func(m *message.Message) ([]*message.Message, error) {
		inHandler = slices.Sorted(maps.Keys(m.Metadata))
		return nil, nil
	})
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	want := slices.Sorted(slices.Values(append(slices.Clone(before), middleware.AttemptKey)))
	if !slices.Equal(inHandler, want) {
		t.Fatalf("handler metadata keys %v, want the delivery's %v plus %s only", inHandler, before, middleware.AttemptKey)
	}
	if len(inHandler) > 8 {
		t.Fatalf("%d metadata keys for a message with two headers: past Go's small map (8)", len(inHandler))
	}
}

//go:noinline
func stackAddr() uintptr {
	var x byte
	return uintptr(unsafe.Pointer(&x))
}

//go:noinline
func growStack(n int) byte {
	var big [16 << 10]byte
	big[n%len(big)] = byte(n)
	return big[(n*7)%len(big)]
}

// TestHealthyPathStackDepth: the stack the chain puts between the router
// and the handler on the healthy path. The router runs each message on a
// fresh goroutine whose stack starts at 2 KB (less the runtime's guard);
// a chain deep enough to push a light handler past it costs a stack copy
// per message, which measured more than the whole chain's own work (see
// docs/benchmarks.md). 6c05d0d's chain took 648 bytes (this probe, go
// 1.26, amd64) and light handlers ran without a copy; the bound keeps us
// at or below it. Frame sizes are the compiler's: the race detector
// enlarges them, so this runs without -race (make test runs it so).
func TestHealthyPathStackDepth(t *testing.T) {
	if raceEnabled || unsafe.Sizeof(uintptr(0)) != 8 {
		t.Skip("frame sizes measured for 64-bit builds without -race")
	}
	r, msg := footprintRetry(t)
	// Warm up: the first message of a queue resolves its handler deadline.
	if _, err := r.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg); err != nil {
		t.Fatal(err)
	}
	_, msg = footprintRetry(t)
	var outer, inner uintptr
	h := r.Middleware(func(*message.Message) ([]*message.Message, error) { inner = stackAddr(); return nil, nil })
	done := make(chan struct{})
	go func() {
		defer close(done)
		growStack(1) // no copy while measuring
		outer = stackAddr()
		_, _ = h(msg)
	}()
	<-done
	depth := int(outer - inner)
	t.Logf("chain stack depth on the healthy path: %d bytes", depth)
	const bound = 648
	if depth > bound {
		t.Fatalf("the chain takes %d bytes of stack between the router and the handler, more than %d: a light handler now pays a stack copy per message", depth, bound)
	}
}
