package faults

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/internal/cascadecore"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// The fault scenarios with the delay cascade selected
// (amqpretry.Config.Mode = cascade.Mode): retries wait
// in the cascade's quorum level queues (at-least-once dead-lettering), not
// in wait queues; zero-delay copies (fallback, RedeliveryGuard) still use
// the loop-back exchange.

// cascadeEnv is a quorum-queue env whose retries go through a cascade of
// its own (unique Prefix, default 100 ms grain and 26 levels), deleted at
// the end.
func cascadeEnv(t *testing.T, opts ...envOption) (*env, cascade.Config) {
	t.Helper()
	ccfg := cascade.Config{Prefix: uniquePrefix(t) + ".cascade"}
	e := newEnv(t, amqpretry.QueueTypeQuorum, append([]envOption{func(_ *env, c *amqpretry.Config) {
		c.Mode = cascade.Mode(ccfg)
	}}, opts...)...)
	t.Cleanup(func() {
		ch := e.admin.channel()
		defer ch.Close()
		if err := cascadeCore(ccfg).Delete(ch); err != nil {
			t.Errorf("deleting the cascade: %v", err)
		}
	})
	return e, ccfg
}

// cascadeWaiting is the number of messages ready in the cascade's level
// queues (-1 if they cannot be read now, e.g. during a restart).
func cascadeWaiting(e *env, ccfg cascade.Config) int { return cascadeWaitingAdmin(e.admin, ccfg) }

// cascadeSettle is env.settle for the cascade: every message completed,
// Q and the level queues empty, and nothing changing for 2 s (longer than
// the longest retry delay, 400 ms, plus the hops: no duplicate is still on
// its way). A quorum level queue does not count an expired message whose
// dead-lettering is being retried (see the cascade doc): the window covers
// the normal case; a stuck message would show as lost.
func cascadeSettle(e *env, ccfg cascade.Config, n int, completed func() int, timeout time.Duration) bool {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	var stableSince time.Time
	last := -1
	for time.Now().Before(deadline) {
		c, p := completed(), e.poisonDepth()
		if c+p >= n && e.depth(e.queue) == 0 && cascadeWaiting(e, ccfg) == 0 {
			if c+p != last {
				last, stableSince = c+p, time.Now()
			} else if time.Since(stableSince) > 2*time.Second {
				return true
			}
		} else {
			last = -1
		}
		time.Sleep(100 * time.Millisecond) // polling interval, not a synchronisation point
	}
	return false
}

// TestCascadeBrokerRestartMidStorm is TestBrokerRestartMidStorm with the
// cascade: 2,000 persistent messages, 30 % failing once or twice (retries
// after 200 and 400 ms through the quorum level queues), the broker app
// restarted twice mid-storm. Every message ends handled, none is lost or
// poisoned; the retries waiting in the levels at each restart are logged.
func TestCascadeBrokerRestartMidStorm(t *testing.T) {
	requireDisruptive(t)
	haveRabbitmqctl(t)
	t.Cleanup(func() { ensureBrokerApp(t) })
	e, ccfg := cascadeEnv(t)
	const n = 2000
	uuids, ps := newMessages(n, nil)
	plan := transientPlan(uuids, 30, 1)
	l := newLedger()
	e.declare()
	e.publish(ps...)
	e.start(planHandler(l, staticPlan(plan), 2*time.Millisecond, nil))

	progress := func(min int) {
		t.Helper()
		waitFor(t, 2*time.Minute, "storm progress", func() bool { return l.handled() >= min })
	}
	var inLevels, awaiting, handledAt []int
	for i := range 2 {
		if i == 0 {
			progress(n / 5)
		} else {
			progress(min(l.handled()+n/5, n-n/10))
		}
		inLevels = append(inLevels, cascadeWaiting(e, ccfg))
		awaiting = append(awaiting, l.awaitingRetry())
		handledAt = append(handledAt, l.handled())
		restartBrokerApp(t)
	}
	t.Logf("at the restarts: %v retries in the level queues, %v failed and not yet handled, %v handled", inLevels, awaiting, handledAt)
	if awaiting[0]+awaiting[1] == 0 || handledAt[1] >= n {
		t.Errorf("the restarts did not hit the storm (awaiting %v, handled %v)", awaiting, handledAt)
	}
	if got := len(e.logs.find("error", "Received close notification from AMQP, reconnecting")); got == 0 && testkit.Broker() != "cluster" {
		t.Errorf("the subscriber never logged a reconnect")
	}
	// A quorum level's at-least-once dead-letter worker that lost its
	// target in the restart resends its buffer only after
	// dead_letter_worker_publisher_confirm_timeout (3 min by default,
	// rabbit_fifo_dlx_worker): on 3.10 some retries wait that long (late,
	// never lost). Settle allows for it.
	settled := cascadeSettle(e, ccfg, n, l.handled, 5*time.Minute)
	e.stop()
	poisoned, _ := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	reportPhantoms(t, l)
	if !settled {
		t.Errorf("messages did not settle within 5 min")
	}
	if d := e.depth(e.queue); d != 0 {
		t.Errorf("%d message(s) left in %s", d, e.queue)
	}
	if acc.Lost != 0 || acc.Poisoned != 0 {
		t.Errorf("lost %d, poisoned %d; want 0, 0", acc.Lost, acc.Poisoned)
	}
	t.Logf("%d retries scheduled through the cascade", len(e.logs.find("info", "Retry scheduled")))
}

// TestCascadeConsumerKilled is TestConsumerKilled with the cascade: a
// consumer process (retries through the cascade, -cascade-prefix) is
// SIGKILLed mid-run; its unacked deliveries come back to Q redelivered, so
// the RedeliveryGuard's zero-delay copies (loop-back exchange) and the
// cascade's retry copies are both in play; a second process takes over.
// The success files and the poison queue account for every message.
func TestCascadeConsumerKilled(t *testing.T) {
	requireLong(t)
	e, ccfg := cascadeEnv(t)
	bin := buildConsumer(t, t.TempDir())
	dir := t.TempDir()
	out1, out2 := filepath.Join(dir, "success-1.log"), filepath.Join(dir, "success-2.log")
	extra := []string{"-queue-type", amqpretry.QueueTypeQuorum, "-cascade-prefix", ccfg.Prefix}

	const n = 800
	uuids, ps := newMessages(n, nil)
	e.declare()
	e.publish(ps...)
	count := func() int { return len(successes(t, out1, out2)) }

	c1 := startConsumer(t, bin, e, out1, extra...)
	waitFor(t, 30*time.Second, "first consumer's progress", func() bool { return len(successes(t, out1)) >= n/3 })
	waiting := cascadeWaiting(e, ccfg)
	if err := c1.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := <-c1.done
	if ws, ok := c1.cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("first consumer did not die by SIGKILL: %v", err)
	}
	t.Logf("killed the first consumer after %d successes, %d retries waiting in the cascade", len(successes(t, out1)), waiting)

	c2 := startConsumer(t, bin, e, out2, extra...)
	settled := cascadeSettle(e, ccfg, n, count, 90*time.Second)
	if err := c2.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-c2.done:
		if err != nil {
			t.Errorf("second consumer exit: %v\n%s", err, c2.stderr)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("second consumer did not stop on SIGTERM")
	}
	poisoned, _ := e.poisoned()
	acc := account(t, uuids, successes(t, out1, out2), poisoned)
	if !settled {
		t.Errorf("messages did not settle within 90 s")
	}
	// The second process got the killed one's unacked deliveries
	// redelivered: the RedeliveryGuard moved each, as a counted zero-delay
	// copy through the loop-back exchange, to the quarantine queue (or
	// requeued it in Q). (c2 has exited: its stderr is complete.)
	guardCopies := strings.Count(c2.stderr.String(), "Redelivered message moved to the quarantine queue") +
		strings.Count(c2.stderr.String(), "Redelivered message counted and requeued as a copy")
	t.Logf("RedeliveryGuard zero-delay copies by the second consumer: %d", guardCopies)
	if guardCopies == 0 {
		t.Errorf("no zero-delay copy was made: the scenario did not exercise the loop-back path")
	}
	if acc.Lost != 0 || acc.Poisoned != 0 {
		t.Errorf("lost %d, poisoned %d; want 0, 0", acc.Lost, acc.Poisoned)
	}
	if len(successes(t, out2)) == 0 {
		t.Errorf("the second consumer handled nothing")
	}
}

// TestCascadeClusterKillLevelLeader: on the 3-node cluster, 600 messages
// are scheduled 12.8 s ahead (128 grains: they all wait in level 7 only),
// then the node leading level 7's quorum queue is killed (kill -9) while
// they wait. A new leader takes over the queue; its TTL and at-least-once
// dead-lettering deliver every message to the destination (a quorum queue
// too). All arrive, none is lost; duplicates are counted, not failures.
func TestCascadeClusterKillLevelLeader(t *testing.T) { levelLeaderDown(t, "kill") }

// TestCascadeClusterStopLevelLeader is the same with a clean stop
// (rabbitmqctl stop) of the leader's node: leadership is handed over.
func TestCascadeClusterStopLevelLeader(t *testing.T) { levelLeaderDown(t, "stop") }

func levelLeaderDown(t *testing.T, verb string) {
	c := requireCluster(t)
	uri := brokerURI(t)
	a := newAdmin(t, uri)
	prefix := uniquePrefix(t)
	ccfg := cascade.Config{Prefix: prefix + ".cascade", URI: uri}
	dest := prefix + ".dest"
	ch := a.channel()
	if _, err := ch.QueueDeclare(dest, true, false, false, false, amqp.Table{"x-queue-type": amqpretry.QueueTypeQuorum}); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()
	t.Cleanup(func() {
		ch := a.channel()
		defer ch.Close()
		_ = cascadeCore(ccfg).Delete(ch)
		_, _ = ch.QueueDelete(dest, false, false, false)
	})
	pub, err := cascade.NewPublisher(ccfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Bind(dest); err != nil {
		t.Fatal(err)
	}
	level := cascadeCore(ccfg).LevelName(7)
	const n = 600
	const wait = 12800 * time.Millisecond
	uuids := make([]string, n)
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += 8 {
				msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
				uuids[i] = msg.UUID
				delay.Message(msg, delay.For(wait))
				if err := pub.Publish(dest, msg); err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("publish: %v", err)
	}
	published := time.Since(start)
	leaders, err := c.leaders(level)
	if err != nil || leaders[level] == "" {
		t.Fatalf("leader of %s: %v %v", level, leaders, err)
	}
	target := leaders[level]
	waiting := a.depth(level)
	if time.Since(start) > wait-2*time.Second {
		t.Fatalf("publishing took %v: the messages no longer wait in %s", time.Since(start), level)
	}
	var took time.Duration
	if verb == "kill" {
		took = c.kill(target)
	} else {
		took = c.stop(target)
	}
	elected, newLeaders := c.waitLeaders([]string{level}, target, 2, 60*time.Second)
	t.Logf("published %d in %v; %d waiting in %s; %s %s (its leader) took %v; new leader %v after %v",
		n, published.Round(time.Millisecond), waiting, level, verb, target, took.Round(time.Millisecond), newLeaders, elected.Round(10*time.Millisecond))

	// Receive everything at the destination.
	got := map[string]int{}
	var last time.Time
	ok := poll(3*time.Minute, func() bool {
		for _, d := range a.drain(dest) {
			u, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			got[u]++
			last = time.Now()
		}
		return len(got) >= n
	})
	if !ok {
		t.Errorf("after 3 min %d of %d distinct messages arrived", len(got), n)
	}
	c.start(target)
	// Duplicates still on their way (a dead-lettering repeated by the new
	// leader) would arrive within seconds: settle for 3 s.
	quietSince := time.Now()
	poll(30*time.Second, func() bool {
		if ds := a.drain(dest); len(ds) > 0 {
			for _, d := range ds {
				u, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
				got[u]++
			}
			quietSince = time.Now()
		}
		return time.Since(quietSince) > 3*time.Second && cascadeWaitingAdmin(a, ccfg) == 0
	})
	t.Logf("last message arrived %v after the publish began (due after %v)", last.Sub(start).Round(10*time.Millisecond), wait)
	acc := account(t, uuids, got, map[string]int{})
	if acc.Lost != 0 {
		t.Errorf("lost %d", acc.Lost)
	}
}

// cascadeWaitingAdmin is cascadeWaiting on an admin connection.
func cascadeWaitingAdmin(a *admin, ccfg cascade.Config) int {
	ch := a.channel()
	defer ch.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	counts, err := ccfg.Waiting(ctx, ch)
	if err != nil {
		return -1
	}
	sum := 0
	for _, c := range counts {
		sum += c.Messages
	}
	return sum
}

// diskAlarm raises (on) or clears the broker's disk alarm by moving its
// free-disk limit (set_disk_free_limit; 50 MB is RabbitMQ's default).
func diskAlarm(t *testing.T, on bool) error {
	t.Helper()
	limit := "50000000"
	if on {
		limit = "100000000000000" // 100 TB
	}
	_, err := rabbitmqctl(t, 60*time.Second, "set_disk_free_limit", limit)
	return err
}

func diskAlarmActive(t *testing.T) bool {
	t.Helper()
	out, err := rabbitmqctl(t, 30*time.Second, "-q", "eval", "rabbit_alarm:get_alarms().")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(out, "disk")
}

// TestCascadeCensusDiskAlarm is issue #19.15: a census with a 3 s deadline
// during a disk alarm (which blocks every publishing connection, so its
// put-backs cannot be confirmed) returns within its deadline plus a few
// seconds, and once the alarm clears every waiting message arrives once,
// none early. Before the fix the census blocked for the whole alarm
// (unbounded cancel and close) and 15-52 of 100 messages were duplicated
// (put-back copies applied after the originals had been returned).
// Disruptive (raises the alarm on the broker at AMQP_URI): run it on a
// private node, e.g. `eval "$(scripts/brokers.sh env dev)"`.
func TestCascadeCensusDiskAlarm(t *testing.T) {
	requireDisruptive(t)
	haveRabbitmqctl(t)
	uri := brokerURI(t)
	a := newAdmin(t, uri)
	dest := uniquePrefix(t) + ".dest"
	cfg := cascadecore.Config{Prefix: uniquePrefix(t) + ".cascade", Levels: 12, URI: uri,
		QueueName: func(context.Context) string { return dest }}
	ch := a.channel()
	if _, err := ch.QueueDeclare(dest, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ch := a.channel()
		defer ch.Close()
		_ = cfg.Delete(ch)
		_, _ = ch.QueueDelete(dest, false, false, false)
	})
	d, err := cascadecore.NewDelayer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Bind(dest); err != nil {
		t.Fatal(err)
	}
	const n = 100
	due := map[string]time.Time{}
	var published []string
	for i := range n {
		id := watermill.NewUUID()
		delay := 20*time.Second + time.Duration(i)*50*time.Millisecond
		due[id] = time.Now().Add(delay)
		if err := d.Schedule(context.Background(), message.NewMessage(id, nil), delay); err != nil {
			t.Fatal(err)
		}
		published = append(published, id)
	}
	// The consumer records each arrival (its connection does not publish:
	// the alarm does not block it).
	var mu sync.Mutex
	handled, early := map[string]int{}, 0
	cch := a.channel()
	ds, err := cch.Consume(dest, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for dl := range ds {
			at := time.Now()
			msg, err := (amqpretry.Marshaler{}).Unmarshal(dl)
			if err != nil {
				continue
			}
			mu.Lock()
			handled[msg.UUID]++
			if at.Before(due[msg.UUID].Add(-20 * time.Millisecond)) {
				early++
				t.Errorf("%s arrived %v early", msg.UUID, due[msg.UUID].Sub(at))
			}
			mu.Unlock()
		}
	}()

	t.Cleanup(func() {
		if err := diskAlarm(t, false); err != nil {
			t.Errorf("clearing the disk alarm: %v", err)
		}
	})
	if err := diskAlarm(t, true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the disk alarm", func() bool { return diskAlarmActive(t) })
	alarmAt := time.Now()
	// The alarm lasts 15 s, whatever the census does.
	cleared := make(chan error, 1)
	time.AfterFunc(15*time.Second, func() { cleared <- diskAlarm(t, false) })
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	start := time.Now()
	rep, err := cascadecore.Census(ctx, cfg, cascadecore.CensusOptions{})
	took := time.Since(start)
	t.Logf("census under the disk alarm: returned after %v (deadline 3 s): %v; taken %d, put back %d, returned %d",
		took.Round(time.Millisecond), err, rep.Taken, rep.PutBack, rep.Returned)
	if took > 8*time.Second {
		t.Errorf("the census took %v with a 3 s deadline", took)
	}
	// The alarm outlasts the census (anything it left in the socket is
	// read only once the alarm clears).
	if err := <-cleared; err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the disk alarm to clear", func() bool { return !diskAlarmActive(t) })
	t.Logf("disk alarm cleared after %v", time.Since(alarmAt).Round(time.Second))
	// Every message is due within 25 s of scheduling; the census holds
	// none, so all arrive by then; then 3 s more for any duplicate.
	last := time.Now()
	for _, at := range due {
		last = maxTime(last, at)
	}
	waitFor(t, time.Until(last)+60*time.Second, "every message delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == n
	})
	quietUntil := time.Now().Add(3 * time.Second)
	waitFor(t, 10*time.Second, "3 s for duplicates", func() bool { return time.Now().After(quietUntil) })
	mu.Lock()
	defer mu.Unlock()
	acc := account(t, published, cloneMap(handled), nil)
	t.Logf("EARLY %s: early=%d", t.Name(), early)
	if acc.Duplicates != 0 {
		t.Errorf("%d duplicates", acc.Duplicates)
	}
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// cascadeCore is c's naming as the cascade's machinery takes it (Delete,
// LevelName): the settings of a test cascade that tells only Prefix, Grain,
// Levels and QueueType.
func cascadeCore(c cascade.Config) cascadecore.Config {
	return cascadecore.Config{Prefix: c.Prefix, Grain: c.Grain, Levels: c.Levels, QueueType: c.QueueType}
}
