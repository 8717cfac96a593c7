package faults

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// settingsChange is one deploy: a change to the config of the next run.
type settingsChange struct {
	name   string
	change func(e *env, c *amqpretry.Config)
}

// evolve runs the same queue through len(changes)+1 consumer runs (the
// first with e's config, each next one with one more change), publishing
// messages paced (10 every 100 ms, at most n) until the last run starts;
// message i fails its first i%4 attempts. Each run is stopped once every wait tier of its config holds
// messages, so each deploy happens with retries waiting in every tier
// (and, in the later runs, in the previous runs' wait queues). Nothing may
// be lost, nothing poisoned, and every run must start.
func evolve(t *testing.T, e *env, n int, changes []settingsChange) {
	uuids, ps := newMessages(n, nil)
	plan := map[string]int{}
	for i, u := range uuids {
		plan[u] = i % 4
	}
	l := newLedger()
	handler := planHandler(l, staticPlan(plan), 0, nil)
	e.declare()

	// Paced publishing across the runs, until the last one starts.
	var published atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		for off := 0; off < n; off += 10 {
			e.publish(ps[off:min(off+10, n)]...)
			published.Store(int64(min(off+10, n)))
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond): // pacing the producer, not synchronisation
			}
		}
	}()
	defer func() { cancel(); <-pubDone }()

	var orphans []string
	for run := 0; run <= len(changes); run++ {
		if run > 0 {
			c := changes[run-1]
			old := e.retry
			cfg := e.cfg
			c.change(e, &cfg)
			r, err := amqpretry.New(cfg)
			if err != nil {
				t.Fatalf("deploy %q: New: %v", c.name, err)
			}
			for _, wq := range old.Topology().WaitQueues(e.queue) {
				if !slices.Contains(r.Topology().WaitQueues(e.queue), wq) && !slices.Contains(orphans, wq) {
					orphans = append(orphans, wq)
				}
			}
			for _, ex := range []string{e.cfg.Naming.LoopBackExchange, e.cfg.Naming.WaitExchange, e.cfg.Naming.PoisonExchange} {
				if !slices.Contains(e.extraExchanges, ex) {
					e.extraExchanges = append(e.extraExchanges, ex)
				}
			}
			_ = old.Close()
			e.retry, e.cfg = r, cfg
			t.Logf("deploy %d (%s): tiers %v, MaxAttempts %d, exchanges %s %s %s", run, c.name, r.Topology().Tiers(),
				cfg.MaxAttempts, cfg.Naming.LoopBackExchange, cfg.Naming.WaitExchange, cfg.Naming.PoisonExchange)
		}
		if run == len(changes) {
			cancel()
			<-pubDone
		}
		e.start(handler)
		if run == len(changes) {
			break
		}
		waitFor(t, time.Minute, "messages waiting in every tier", func() bool {
			for _, wq := range e.waitQueues() {
				if e.depth(wq) <= 0 {
					return false
				}
			}
			return true
		})
		waiting := map[string]int{}
		for _, wq := range append(e.waitQueues(), orphans...) {
			waiting[wq] = e.depth(wq)
		}
		e.stop()
		t.Logf("run %d stopped with %d published, %d handled; waiting: %v", run, published.Load(), l.handled(), waiting)
	}
	e.extraQueues = append(e.extraQueues, orphans...)
	n = int(published.Load())
	uuids = uuids[:n]
	settled := e.settle(n, l.handled, 2*time.Minute)
	e.stop()
	for _, wq := range orphans {
		if d := e.depth(wq); d != 0 {
			t.Errorf("orphan wait queue %s still holds %d", wq, d)
		}
	}
	poisoned, ds := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	for _, d := range ds {
		t.Logf("poisoned: class %v, attempts %v, error %v, runs %v", d.Headers[middleware.ErrorClassKey],
			d.Headers[middleware.PoisonAttemptsKey], d.Headers[middleware.LastErrorKey], l.attemptsOf(d.MessageId))
		t.Logf("DEBUG headers %v", d.Headers)
	}
	if !settled {
		t.Errorf("messages did not settle within 2 min")
	}
	e.checkEmpty()
	if acc.Poisoned != 0 {
		t.Errorf("%d poisoned; each fails at most 3 times and every config allows more attempts", acc.Poisoned)
	}
}

// renamed returns Naming with new exchange names (same queue names).
func renamed(e *env, tag string) amqpretry.Naming {
	n := e.cfg.Naming
	n.LoopBackExchange = e.prefix + "." + tag + ".loopback"
	n.WaitExchange = e.prefix + "." + tag + ".wait"
	n.PoisonExchange = e.prefix + "." + tag + ".poison"
	return n
}

// Settings that change between deploys: the tiers (a tier removed, one
// added), MaxAttempts and the backoff, and the names of all three
// exchanges. Each is a restart with retries waiting in every tier of the
// previous run: no failed start (Q's arguments depend on none of them),
// and the retries in a removed tier's wait queue still come back to Q
// (through the default exchange).
func TestSettingsChangeAcrossDeploys(t *testing.T) {
	requireLong(t)
	changes := []settingsChange{
		{"tiers 1s,2s,4s -> 500ms,1s,2s", func(_ *env, c *amqpretry.Config) {
			c.Mode = amqpretry.Tiers(500*time.Millisecond, time.Second, 2*time.Second)
			c.Backoff = exactBackoff(500 * time.Millisecond)
		}},
		{"exchanges renamed", func(e *env, c *amqpretry.Config) { c.Naming = renamed(e, "v2") }},
		{"MaxAttempts 5 -> 7, backoff 500ms -> 1s", func(_ *env, c *amqpretry.Config) {
			c.MaxAttempts = 7
			c.Backoff = exactBackoff(time.Second)
		}},
	}
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt, func(_ *env, c *amqpretry.Config) {
			c.Backoff = exactBackoff(time.Second)
			c.Mode = amqpretry.Tiers(time.Second, 2*time.Second, 4*time.Second)
		})
		evolve(t, e, 3000, changes)
	})
}

// The nack-based modes keep settings in Q's dead-letter routing key
// (DeadLetterFirstRetry: the first wait queue) or delayed-retry arguments
// (NativeDelayedRetry: Min, Max). On an adopted queue those live in the
// library's policy, which a deploy updates on the live queue: changing the
// first tier, or Min and Max, is a restart too.
func TestSettingsChangeAcrossDeploysByPolicy(t *testing.T) {
	requireLong(t)
	mgmt := testkit.HaveMgmt(t)
	t.Run("DeadLetterFirstRetry", func(t *testing.T) {
		e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
			c.Backoff = exactBackoff(time.Second)
			c.Mode = amqpretry.DeadLetterFirst(time.Second, 2*time.Second, 4*time.Second)
			c.AdoptQueue = &amqpretry.AdoptQueue{ManagementURL: mgmt}
		})
		deletePolicyAtCleanup(t, mgmt, e.queue)
		evolve(t, e, 3000, []settingsChange{
			{"first tier 1s -> 500ms", func(_ *env, c *amqpretry.Config) {
				c.Mode = amqpretry.DeadLetterFirst(500*time.Millisecond, 2*time.Second, 4*time.Second)
				c.Backoff = exactBackoff(500 * time.Millisecond)
			}},
		})
	})
	t.Run("NativeDelayedRetry", func(t *testing.T) {
		if !brokerAtLeast43() {
			t.Skip("native delayed retry needs RabbitMQ 4.3+ (RABBITRETRY_BROKER_VERSION)")
		}
		e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
			// Native for the 1 s retries, wait queues above: 2 s, 4 s.
			c.Backoff = exactBackoff(time.Second)
			c.MaxAttempts = 8 // room for the returns a stop costs (x-acquired-count)
			c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: time.Second, Max: time.Second, Tiers: []time.Duration{2 * time.Second, 4 * time.Second}})
			c.AdoptQueue = &amqpretry.AdoptQueue{ManagementURL: mgmt}
		})
		deletePolicyAtCleanup(t, mgmt, e.queue)
		evolve(t, e, 3000, []settingsChange{
			{"native Min/Max 1s -> 500ms/1s", func(_ *env, c *amqpretry.Config) {
				c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: 500 * time.Millisecond, Max: time.Second, Tiers: []time.Duration{2 * time.Second, 4 * time.Second}})
			}},
		})
	})
}
