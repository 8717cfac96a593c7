package faults

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
	padmin "github.com/rabbitretry/rabbitretry/poison/admin"
)

// Issue 18 item 4. A message poisoned under each class (exhausted,
// permanent, redelivery-limit, and one that arrived with malformed retry
// headers) is replayed from the poison queue (poisonctl replay's
// admin.Replay) and gets a fresh set of attempts: MaxAttempts runs, and no
// redelivery count, as a new message would. Before, the replayed copy kept
// rabbitretry-redeliveries, so the message poisoned by the RedeliveryGuard
// was poisoned again at its first redelivery, without running.
//
// The redelivery-limit one is poisoned by real crashes: the consumer
// process (cmd/faults-consumer) SIGKILLs itself on it (see TestCrashLoop).
func TestReplayStartsFreshAttempts(t *testing.T) {
	requireLong(t)
	bin := buildConsumer(t, t.TempDir())
	for _, qt := range []string{"classic", "quorum"} {
		t.Run(qt, func(t *testing.T) { testReplayStartsFreshAttempts(t, bin, qt) })
	}
}

func testReplayStartsFreshAttempts(t *testing.T, bin, queueType string) {
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
	ps[3].Headers[retrymeta.RedeliveriesKey] = "-7"

	// Phase 1a: the pill crashes its consumer process until the guard
	// poisons it (class redelivery-limit).
	e.declare()
	e.publish(ps[2])
	dir := t.TempDir()
	for crashes := 0; e.poisonDepth() < 1; crashes++ {
		if crashes > 4 {
			t.Fatalf("the pill is not poisoned after %d crashes", crashes)
		}
		c := startCrashingConsumer(t, bin, e, filepath.Join(dir, fmt.Sprintf("out-%d", crashes)), "-prefetch", "1",
			"-fail-percent", "0", "-crash-payload", "pill", "-max-redeliveries", "1", "-max-attempts", fmt.Sprint(maxAttempts))
		exited := false
		waitFor(t, 60*time.Second, "a crash or the poisoning", func() bool {
			select {
			case <-c.done:
				exited = true
				return true
			default:
				return e.poisonDepth() == 1
			}
		})
		if !exited {
			// Poisoned: stop it gracefully (SIGTERM), so the pill's delivery
			// is acked and not redelivered to the next consumer.
			_ = c.cmd.Process.Signal(syscall.SIGTERM)
			<-c.done
		}
	}

	var (
		replayed atomic.Bool // phase 2: after the replay
		mu       sync.Mutex
		after    = map[string][]int{} // attempts seen after the replay
		redeliv  = map[string]int{}   // redelivery counts seen after the replay
	)
	l := newLedger()
	// Phase 1b: the others end in the poison queue, each under its class.
	e.start(func(msg *message.Message) error {
		kind := string(msg.Payload)
		if !replayed.Load() {
			if kind == "permanent" {
				return middleware.Permanent(errors.New("order rejected"))
			}
			return errTransient
		}
		a := middleware.Attempt(msg)
		mu.Lock()
		after[msg.UUID] = append(after[msg.UUID], a)
		redeliv[msg.UUID] = max(redeliv[msg.UUID], retrymeta.Redeliveries(msg))
		mu.Unlock()
		if a < maxAttempts {
			return errTransient
		}
		l.success(msg.UUID)
		return nil
	})
	e.publish(ps[0], ps[1], ps[3])
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

	// Phase 2: replay all; each runs MaxAttempts times and succeeds, with
	// no redelivery count (the pill's would poison it at its next
	// redelivery, MaxRedeliveries 1).
	replayed.Store(true)
	res, err := adm.Replay(ctx, e.poisonQueue(), padmin.Filter{}, padmin.ReplayOptions{})
	if err != nil || res.Replayed != len(kinds) {
		t.Fatalf("replay: %+v, %v", res, err)
	}
	settled := e.settle(len(kinds), l.handled, 60*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	for _, d := range ds {
		t.Errorf("poisoned again after the replay: %s class %v redeliveries %v", d.Body, d.Headers[middleware.ErrorClassKey], d.Headers[retrymeta.RedeliveriesKey])
	}
	mu.Lock()
	defer mu.Unlock()
	for i, u := range uuids {
		if got := after[u]; !slices.Equal(got, []int{1, 2, 3}) {
			t.Errorf("%s: attempts after the replay %v, want [1 2 3]", kinds[i], got)
		}
		if redeliv[u] != 0 {
			t.Errorf("%s: redelivery count %d after the replay, want 0", kinds[i], redeliv[u])
		}
	}
	if acc.Handled != len(kinds) || acc.Poisoned != 0 || acc.Duplicates != 0 {
		t.Errorf("want every replayed message handled once")
	}
}
