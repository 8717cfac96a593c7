package faults

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// router.Close() while retries wait in a wait queue and while a handler is
// blocked on its context: the handler returns ctx.Err(), which the default
// classifier retries (never poisons); the waiting retries stay in the
// broker. A new router then handles every message.
//
// Contrast: TestWatermillRetryPoisonsOnShutdown, where Watermill's own
// Retry + PoisonQueue poison a message whose retry sleep is cut short by the
// same shutdown.
func TestGracefulShutdown(t *testing.T) {
	requireLong(t)
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) {
		c.Mode = amqpretry.Tiers(3 * time.Second)
		c.Backoff = exactBackoff(3 * time.Second)
	})
	l := newLedger()
	const waiting = 20
	waitUUIDs, waitPs := newMessages(waiting, nil)
	blockUUIDs, blockPs := newMessages(1, func(int) []byte { return []byte("block") })
	var blocked, ctxErrs atomic.Int32
	e.declare()
	e.start(func(msg *message.Message) error {
		a := middleware.Attempt(msg)
		l.attempt(msg.UUID, a)
		if string(msg.Payload) == "block" {
			blocked.Add(1)
			<-msg.Context().Done() // a slow call that honours its context
			ctxErrs.Add(1)
			return msg.Context().Err()
		}
		if a == 1 {
			return errTransient
		}
		l.success(msg.UUID)
		return nil
	})
	e.publish(waitPs...)
	waitFor(t, 20*time.Second, "first attempts", func() bool {
		for _, u := range waitUUIDs {
			if len(l.attemptsOf(u)) == 0 {
				return false
			}
		}
		return true
	})
	e.publish(blockPs...)
	waitFor(t, 10*time.Second, "a handler blocked mid-flight", func() bool { return blocked.Load() == 1 })

	inWait := e.depth(e.waitQueues()[0])
	start := time.Now()
	e.stop()
	t.Logf("closed the router with %d retries in the 3 s wait queue and one handler mid-flight", inWait)
	if inWait == 0 {
		t.Errorf("no retry was waiting when the router closed")
	}
	t.Logf("router closed in %v; handler returned ctx errors %d time(s)", time.Since(start).Round(time.Millisecond), ctxErrs.Load())
	if ctxErrs.Load() != 1 {
		t.Fatalf("the blocked handler did not see its context cancelled")
	}
	if d := e.poisonDepth(); d != 0 {
		t.Fatalf("%d message(s) poisoned by the shutdown", d)
	}
	if got := e.logs.find("", "Message poisoned"); len(got) != 0 {
		t.Fatalf("poisoned on shutdown: %v", got[0].Fields)
	}

	// A new router, with a handler that no longer blocks.
	e.start(func(msg *message.Message) error {
		l.attempt(msg.UUID, middleware.Attempt(msg))
		l.success(msg.UUID)
		return nil
	})
	all := append(waitUUIDs, blockUUIDs...)
	settled := e.settle(len(all), l.handled, 30*time.Second)
	e.stop()
	poisoned, _ := e.poisoned()
	acc := account(t, all, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	if acc.Poisoned != 0 {
		t.Errorf("%d message(s) poisoned", acc.Poisoned)
	}
	// At-least-once: watermill-amqp nacks the in-flight delivery as soon as
	// the subscriber closes ("Message not consumed, subscriber is closed";
	// the nack dead-letters it into the wait path), and the handler's
	// context error then schedules a retry copy too: two copies come back.
	t.Logf("blocked message attempts: %v; watermill-amqp nacks on close: %d",
		l.attemptsOf(blockUUIDs[0]), len(e.logs.find("", "Message not consumed, subscriber is closed")))
}

// Watermill's own Retry middleware waits between attempts inside the
// handler; when the router shuts down during that wait, backoff returns the
// context's error and PoisonQueue (which poisons every error by default)
// publishes the message to the poison topic: a transient failure that met a
// deploy ends up poisoned after one attempt. rabbitretry waits in the broker
// instead and classifies context.Canceled as transient
// (TestGracefulShutdown). Shown with gochannel.
func TestWatermillRetryPoisonsOnShutdown(t *testing.T) {
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	defer pubSub.Close()
	// The router closes its subscriber (the whole gochannel) on Close: keep
	// the poison topic on its own persistent gochannel.
	poisonPubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	defer poisonPubSub.Close()
	poisonMW, err := wmw.PoisonQueue(poisonPubSub, "poison")
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(poisonMW, wmw.Retry{MaxRetries: 5, InitialInterval: 10 * time.Second, Multiplier: 2}.Middleware)
	var attempts atomic.Int32
	r.AddConsumerHandler("svc", "orders", pubSub, func(msg *message.Message) error {
		attempts.Add(1)
		return errTransient
	})
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
	if err := pubSub.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "first attempt", func() bool { return attempts.Load() == 1 })
	// Retry is now waiting (or about to wait) out its 10 s interval; either
	// way its select sees the router's context cancelled.
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	poisoned, err := poisonPubSub.Subscribe(context.Background(), "poison")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-poisoned:
		p.Ack()
		reason := p.Metadata.Get(wmw.ReasonForPoisonedKey)
		t.Logf("Watermill Retry+PoisonQueue poisoned %s after %d attempt(s) at shutdown, reason %q", p.UUID, attempts.Load(), reason)
		if p.UUID != msg.UUID || attempts.Load() != 1 {
			t.Errorf("poisoned %s after %d attempts", p.UUID, attempts.Load())
		}
		if !strings.Contains(reason, context.Canceled.Error()) {
			t.Errorf("reason %q, want the context's error", reason)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Watermill's Retry+PoisonQueue did not poison the message at shutdown (behaviour changed?)")
	}
}
