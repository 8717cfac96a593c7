package faults

import (
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
)

// maxStormBacklog bounds the messages a storm has published and not yet
// seen handled: waves pause above it, so what is left to drain after the
// fault does not depend on how long the fault took.
const maxStormBacklog = 1000

// storm configures runStorm.
type storm struct {
	// pause between waves of 50 messages.
	pause time.Duration
	// phantomErr is what the handler returns for a message nobody
	// published (nil: ack it).
	phantomErr error
	// work is the simulated handler work per attempt.
	work time.Duration
	// allowPhantoms logs phantom deliveries instead of failing the test.
	allowPhantoms bool
}

// runStorm runs a storm: waves of 50 messages, 30% of them failing
// transiently once or twice, every pause. Once 150 messages are handled it
// calls inject, with the waves still coming; it publishes 6 more waves after
// inject returned, then checks the accounting: everything handled, nothing
// poisoned, nothing left behind.
func runStorm(t *testing.T, e *env, cfg storm, inject func(l *ledger)) (accounting, *ledger) {
	t.Helper()
	const wave = 50
	l := newLedger()
	var (
		mu      sync.Mutex
		plan    = map[string]int{}
		uuids   []string
		seed    uint64
		injectD = make(chan struct{})
	)
	e.declare()
	e.start(planHandler(l, func(u string) (int, bool) {
		mu.Lock()
		defer mu.Unlock()
		f, ok := plan[u]
		return f, ok
	}, cfg.work, cfg.phantomErr))
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		after := 0
		for after < 6 {
			mu.Lock()
			backlog := len(uuids) - l.handled()
			mu.Unlock()
			if backlog > maxStormBacklog {
				// The consumer is behind (a slow reconnect, a loaded
				// machine): wait for it instead of growing a queue that
				// the settle bound cannot drain.
				time.Sleep(cfg.pause)
				continue
			}
			select {
			case <-injectD:
				after++
			default:
			}
			us, ps := newMessages(wave, nil)
			seed++
			mu.Lock()
			for u, f := range transientPlan(us, 30, seed) {
				plan[u] = f
			}
			uuids = append(uuids, us...)
			mu.Unlock()
			e.publish(ps...)
			time.Sleep(cfg.pause)
		}
	}()
	waitFor(t, 60*time.Second, "150 messages handled", func() bool { return l.handled() >= 150 })
	inject(l)
	close(injectD)
	<-pubDone
	mu.Lock()
	published := slices.Clone(uuids)
	mu.Unlock()
	settled := e.settle(len(published), l.handled, 90*time.Second)
	e.stop()
	poisoned, _ := e.poisoned()
	acc := account(t, published, l.successes(), poisoned)
	if !settled {
		t.Errorf("messages did not settle within 90 s")
	}
	e.checkEmpty()
	if acc.Poisoned != 0 {
		t.Errorf("%d messages poisoned; each fails at most twice with 5 attempts", acc.Poisoned)
	}
	if ph := l.phantomDeliveries(); len(ph) > 0 && !cfg.allowPhantoms {
		t.Errorf("%d phantom deliveries (messages nobody published) reached the handler: %v", len(ph), ph[:min(len(ph), 5)])
	}
	return acc, l
}

// The retry publish cannot reach its destination under load: the wait queue
// or the wait exchange is deleted, the retry publisher is closed, or its
// connection is closed by the broker. Every message still ends handled: the
// Delayer redeclares a missing topology and publishes again; when the
// publish fails anyway the message is nacked with requeue (never acked),
// after the fallback pause, and comes back. The failure is logged.
func TestRepublishFails(t *testing.T) {
	requireLong(t)
	t.Run("DeleteWaitQueue", func(t *testing.T) {
		e := newEnv(t, "classic")
		runStorm(t, e, storm{pause: 500 * time.Millisecond}, func(l *ledger) {
			wq := e.waitQueues()[0]
			// Delete it only while empty (the waves leave gaps longer than
			// its 200 ms TTL): deleting a queue that holds messages destroys
			// them, an operator's loss, not the library's.
			ok := poll(20*time.Second, func() bool {
				ch := e.admin.channel()
				defer ch.Close()
				_, err := ch.QueueDelete(wq, false, true, false)
				return err == nil
			})
			if !ok {
				t.Fatalf("wait queue %s never empty enough to delete", wq)
			}
			t.Logf("deleted %s", wq)
		})
		entries := e.logs.find("error", "Retry publish found no route; redeclaring topology")
		if len(entries) == 0 {
			t.Fatalf("no redeclare logged after the wait queue was deleted")
		}
		if !errors.Is(entries[0].Err, confirm.ErrUnroutable) {
			t.Errorf("logged error %v, want ErrUnroutable", entries[0].Err)
		}
		t.Logf("redeclares logged: %d (first: %v)", len(entries), entries[0].Err)
	})

	t.Run("DeleteWaitExchange", func(t *testing.T) {
		e := newEnv(t, "classic")
		runStorm(t, e, storm{pause: 150 * time.Millisecond}, func(l *ledger) {
			ch := e.admin.channel()
			defer ch.Close()
			if err := ch.ExchangeDelete(e.naming.WaitExchange, false, false); err != nil {
				t.Fatalf("deleting %s: %v", e.naming.WaitExchange, err)
			}
			t.Logf("deleted exchange %s", e.naming.WaitExchange)
		})
		entries := e.logs.find("error", "Retry publish found no route; redeclaring topology")
		if len(entries) == 0 {
			t.Fatalf("no redeclare logged after the wait exchange was deleted")
		}
		var aerr *amqp.Error
		if !errors.As(entries[0].Err, &aerr) || aerr.Code != amqp.NotFound {
			t.Errorf("logged error %v, want a 404 NOT_FOUND channel close", entries[0].Err)
		}
		t.Logf("redeclares logged: %d (first: %v)", len(entries), entries[0].Err)
	})

	t.Run("ClosePublisher", func(t *testing.T) {
		// The retry publisher is closed for good (say, Retry.Close before the
		// router): nothing can be published, so no retry can be scheduled or
		// counted. Messages are never acked unhandled: each failing one is
		// requeued after the fallback pause, and its redelivery is not run
		// again (it cannot be counted); it waits in Q, returned after each
		// pause. A restart with a working Retry finishes them all.
		e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) { c.FallbackPause = 20 * time.Millisecond })
		const n = 200
		uuids, ps := newMessages(n, nil)
		plan := map[string]int{}
		for i, u := range uuids {
			plan[u] = i % 3 // a third succeed at once, a third fail once, a third twice
		}
		l := newLedger()
		e.declare()
		if err := e.retry.Publisher().Close(); err != nil {
			t.Fatalf("closing the retry publisher: %v", err)
		}
		e.start(planHandler(l, staticPlan(plan), 0, errTransient))
		e.publish(ps...)
		waitFor(t, 30*time.Second, "failed retries requeued and their redeliveries held back", func() bool {
			return l.handled() > 0 && len(e.logs.find("error", "Copy of a redelivered message not held")) >= 20
		})
		e.stop()
		entries := e.logs.find("error", "Retry not scheduled; nacking message")
		if !errors.Is(entries[len(entries)-1].Err, confirm.ErrClosed) {
			t.Errorf("logged error %v, want ErrClosed", entries[len(entries)-1].Err)
		}
		if e.poisonDepth() != 0 {
			t.Errorf("poisoned while the publisher was closed")
		}
		left := e.depth(e.queue)
		t.Logf("publisher closed: handled %d, %d still in Q, failed retries requeued %d", l.handled(), left, len(entries))
		if l.handled()+left != n {
			t.Errorf("handled %d + left in Q %d != published %d", l.handled(), left, n)
		}
		// Restart with a working publisher.
		r, err := amqpretry.New(e.cfg)
		if err != nil {
			t.Fatal(err)
		}
		e.retry = r
		e.start(planHandler(l, staticPlan(plan), 0, errTransient))
		settled := e.settle(n, l.handled, 60*time.Second)
		e.stop()
		poisoned, _ := e.poisoned()
		acc := account(t, uuids, l.successes(), poisoned)
		if !settled || acc.Handled != n {
			t.Errorf("settled %v, handled %d of %d", settled, acc.Handled, n)
		}
		e.checkEmpty()
	})

	t.Run("BrokerClosesPublisherConnection", func(t *testing.T) {
		haveRabbitmqctl(t)
		e := newEnv(t, "classic")
		runStorm(t, e, storm{pause: 150 * time.Millisecond}, func(l *ledger) {
			for round := 0; round < 2; round++ {
				// The publisher redials lazily, on its next publish: wait for
				// its connection to be there.
				var pid string
				ok := poll(20*time.Second, func() bool {
					var pids []string
					for _, c := range listConnections(t) {
						if c.Name == e.prefix+".subscriber.retry-publisher" {
							pids = append(pids, c.PID)
						}
					}
					if len(pids) > 1 {
						t.Fatalf("%d publisher connections in this process, want 1", len(pids))
					}
					if len(pids) == 1 {
						pid = pids[0]
					}
					return pid != ""
				})
				if !ok {
					t.Fatalf("round %d: no publisher connection of this process (handled so far: %d)", round, l.handled())
				}
				if _, err := rabbitmqctl(t, 30*time.Second, "close_connection", pid, "fault injection"); err != nil {
					t.Fatal(err)
				}
				t.Logf("round %d: broker closed the publisher connection %s", round, pid)
			}
		})
		if len(e.logs.find("error", "AMQP publisher connection closed; will redial on next publish")) < 2 {
			t.Errorf("the publisher did not log both connection losses")
		}
		t.Logf("failed schedules (requeued by the fallback): %d; connections opened: %d",
			len(e.logs.find("error", "Retry not scheduled; nacking message")),
			len(e.logs.find("info", "AMQP publisher connection opened")))
		if len(e.logs.find("info", "AMQP publisher connection opened")) < 3 {
			t.Errorf("the publisher did not redial after the broker closed its connection")
		}
	})
}
