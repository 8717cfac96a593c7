package cascadecore

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// TestRouterRetry runs the retry chain on a watermill-amqp subscriber with
// the cascade Delayer (queue found from the subscribe topic): a message
// failing twice is retried after 200 ms and 400 ms (exact backoff), then
// succeeds, and the gaps between attempts match the delays.
func TestRouterRetry(t *testing.T) {
	f := newFixture(t, Config{Grain: 50 * time.Millisecond, Levels: 6})
	q := f.cfg.Prefix + ".orders"
	t.Cleanup(func() {
		if ch, err := f.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(q, false, false, false)
			_ = ch.ExchangeDelete(q, false, false)
			_ = ch.Close()
		}
	})
	d := f.delayer()

	subCfg := wamqp.NewDurableQueueConfig(f.uri)
	subCfg.Marshaler = amqpretry.Marshaler{}
	sub, err := wamqp.NewSubscriber(subCfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = poison.Close() })
	chain, err := router.New(router.Config{
		Delayer: d, PoisonPublisher: poison, Policy: router.Policy{MaxAttempts: 4, Backoff: testkit.ExactBackoff(200 * time.Millisecond), FallbackPause: -1},
	})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	chain.AddTo(r)
	var mu sync.Mutex
	var starts []time.Time
	done := make(chan int, 1)
	r.AddConsumerHandler("h", q, sub, func(msg *message.Message) error {
		mu.Lock()
		starts = append(starts, time.Now())
		mu.Unlock()
		if a := middleware.Attempt(msg); a < 3 {
			return errors.New("flaky")
		}
		done <- middleware.Attempt(msg)
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() { defer close(runDone); _ = r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-runDone })
	<-r.Running()

	p, err := NewPublisher(f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	if err := p.Publish(q, message.NewMessage("order-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	if a := testkit.Recv(t, done, 15*time.Second); a != 3 {
		t.Fatalf("succeeded on attempt %d, want 3", a)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, want := range []time.Duration{200 * time.Millisecond, 400 * time.Millisecond} {
		gap := starts[i+1].Sub(starts[i])
		if gap < want-10*time.Millisecond || gap > want+lateTolerance {
			t.Errorf("gap before attempt %d: %v, want %v (+%v)", i+2, gap, want, lateTolerance)
		}
		t.Logf("attempt %d came %v after attempt %d (delay %v, %+v)", i+2, gap.Round(time.Millisecond), i+1, want, (gap - want).Round(time.Millisecond))
	}
}
