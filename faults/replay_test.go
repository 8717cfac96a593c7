package faults

import (
	"context"
	"errors"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	padmin "github.com/rabbitretry/rabbitretry/poison/admin"
)

// Issue 18 item 4. A message poisoned under each class (exhausted,
// permanent, redelivery-limit, and one that arrived with malformed retry
// headers) is replayed from the poison queue (poisonctl replay's
// admin.Replay) and gets a fresh set of attempts: MaxAttempts runs, and
// MaxRedeliveries redeliveries, as a new message would. Before, the replayed
// copy kept rabbitretry-redeliveries, so the message poisoned by the
// RedeliveryGuard was poisoned again at its first redelivery, without
// running.
//
// A crash is the broker closing the consumer's connection while the handler
// holds the message (see TestCrashLoopEndsInPoison); prefetch 1 so that only
// the crashing message is in flight.
func TestReplayStartsFreshAttempts(t *testing.T) {
	haveRabbitmqctl(t)
	for _, qt := range []string{"classic", "quorum"} {
		t.Run(qt, func(t *testing.T) { testReplayStartsFreshAttempts(t, qt) })
	}
}

func testReplayStartsFreshAttempts(t *testing.T, queueType string) {
	const maxAttempts = 3
	e := newEnv(t, queueType, func(_ *env, c *amqpretry.Config) {
		c.Subscriber.Consume.Qos.PrefetchCount = 1
		c.MaxAttempts = maxAttempts
		c.MaxRedeliveries = 1
	})
	kinds := []string{"exhausted", "permanent", "pill", "header"}
	uuids, ps := newMessages(len(kinds), func(i int) []byte { return []byte(kinds[i]) })
	// Malformed retry state from the producer: ignored (HeaderErrorKey), and
	// gone after the replay.
	ps[3].Headers["x-death"] = "not a table"
	ps[3].Headers[middleware.AttemptKey] = "not a number"
	ps[3].Headers[middleware.RedeliveriesKey] = "-7"

	var (
		replayed atomic.Bool // phase 2: after the replay
		crash    atomic.Bool // the pill's next run crashes
		mu       sync.Mutex
		after    = map[string][]int{} // attempts seen after the replay
	)
	l := newLedger()
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	e.declare()
	e.start(func(msg *message.Message) error {
		kind := string(msg.Payload)
		if kind == "pill" && crash.Load() {
			entered <- struct{}{}
			<-release
			return errTransient
		}
		if !replayed.Load() {
			if kind == "permanent" {
				return middleware.Permanent(errors.New("order rejected"))
			}
			return errTransient
		}
		a := middleware.Attempt(msg)
		mu.Lock()
		after[msg.UUID] = append(after[msg.UUID], a)
		mu.Unlock()
		if a < maxAttempts {
			return errTransient
		}
		l.success(msg.UUID)
		return nil
	})
	crashPill := func(stopCrashing bool) {
		t.Helper()
		select {
		case <-entered:
		case <-time.After(30 * time.Second):
			t.Fatal("the pill did not reach the handler")
		}
		if stopCrashing {
			crash.Store(false)
		}
		consuming := len(e.logs.find("info", "Starting consuming from AMQP channel"))
		closeSubscriberConnection(t, e)
		release <- struct{}{}
		waitFor(t, 30*time.Second, "the subscriber to reconnect", func() bool {
			return len(e.logs.find("info", "Starting consuming from AMQP channel")) > consuming
		})
	}

	// Phase 1: every message ends in the poison queue, each under its class.
	crash.Store(true)
	e.publish(ps...)
	crashPill(false) // first delivery: the guard counts the redelivery (1 = MaxRedeliveries)
	crashPill(true)  // the guard's copy: its redelivery is over the limit
	waitFor(t, 30*time.Second, "all four messages poisoned", func() bool { return e.poisonDepth() == len(kinds) })
	adm, err := padmin.New(padmin.Config{URI: e.uri, LoopBackExchange: e.naming.LoopBackExchange})
	if err != nil {
		t.Fatal(err)
	}
	defer adm.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	listed, err := adm.List(ctx, e.poisonQueue(), padmin.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	var classes []string
	for _, m := range listed {
		classes = append(classes, m.Class)
	}
	sort.Strings(classes)
	want := []string{middleware.ClassExhausted, middleware.ClassExhausted, middleware.ClassPermanent, middleware.ClassRedeliveryLimit}
	if !slices.Equal(classes, want) {
		t.Fatalf("poisoned classes %v, want %v", classes, want)
	}

	// Phase 2: replay all; each runs MaxAttempts times and succeeds, the
	// pill after one more crash (a fresh redelivery allowance).
	replayed.Store(true)
	crash.Store(true)
	res, err := adm.Replay(ctx, e.poisonQueue(), padmin.Filter{}, padmin.ReplayOptions{})
	if err != nil || res.Replayed != len(kinds) {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	crashPill(true)
	settled := e.settle(len(kinds), l.handled, 60*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	for _, d := range ds {
		t.Errorf("poisoned again after the replay: %s class %v redeliveries %v", d.Body, d.Headers[middleware.ErrorClassKey], d.Headers[middleware.RedeliveriesKey])
	}
	mu.Lock()
	defer mu.Unlock()
	for i, u := range uuids {
		if got := after[u]; !slices.Equal(got, []int{1, 2, 3}) {
			t.Errorf("%s: attempts after the replay %v, want [1 2 3]", kinds[i], got)
		}
	}
	if acc.Handled != len(kinds) || acc.Poisoned != 0 || acc.Duplicates != 0 {
		t.Errorf("want every replayed message handled once")
	}
}
