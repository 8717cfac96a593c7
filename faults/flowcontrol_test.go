package faults

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// flowObserver times each failed retry schedule: from the handler's error
// return to the chain's RetryFailed, i.e. how long the Delayer held the
// subscription before giving up.
type flowObserver struct {
	middleware.NopObserver

	mu          sync.Mutex
	handlerDone map[string]time.Time // uuid -> when the handler returned its error
	failures    []scheduleFailure
	scheduled   int
	other       int // RetryFailed without a handler run (e.g. the RedeliveryGuard's copy)
}

type scheduleFailure struct {
	uuid string
	took time.Duration
	err  error
}

func newFlowObserver() *flowObserver { return &flowObserver{handlerDone: map[string]time.Time{}} }

func (o *flowObserver) handlerFailed(uuid string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.handlerDone[uuid] = time.Now()
}

func (o *flowObserver) RetryScheduled(msg *message.Message, _ int, _, _ time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.handlerDone, msg.UUID)
	o.scheduled++
}

func (o *flowObserver) RetryFailed(msg *message.Message, _ int, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	start, ok := o.handlerDone[msg.UUID]
	if !ok {
		o.other++
		return
	}
	delete(o.handlerDone, msg.UUID)
	o.failures = append(o.failures, scheduleFailure{uuid: msg.UUID, took: time.Since(start), err: err})
}

func (o *flowObserver) snapshot() ([]scheduleFailure, int, int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.failures), o.scheduled, o.other
}

// memoryAlarm raises (on) or clears the broker's memory alarm.
func memoryAlarm(t *testing.T, on bool) error {
	t.Helper()
	wm := "0.4" // RabbitMQ's default
	if on {
		wm = "0.0000001"
	}
	_, err := rabbitmqctl(t, 60*time.Second, "set_vm_memory_high_watermark", wm)
	return err
}

func memoryAlarmActive(t *testing.T) bool {
	t.Helper()
	out, err := rabbitmqctl(t, 30*time.Second, "-q", "eval", "rabbit_alarm:get_alarms().")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(out, "memory")
}

// Item 5 of "Nothing lost on any path": broker flow control. A memory alarm
// makes RabbitMQ block every publishing connection (connection.blocked) and
// stop reading from it: a publisher that keeps writing waits for confirms
// that cannot come, and a large message blocks in the socket write itself,
// holding the connection's send lock.
//
// The test raises the alarm on the broker at AMQP_URI with RABBITRETRY_CTL
// (set_vm_memory_high_watermark) and clears it at the end. An alarm blocks
// EVERY publisher of the node, so never point it at a broker others use;
// during development run it on a private node, e.g. (RABBITMQ_CONFIG_FILE:
// a file with "listeners.tcp.local = 127.0.0.1:5699", since
// /etc/rabbitmq/rabbitmq.conf pins 5672):
//
//	RABBITMQ_NODENAME=rrflow@localhost RABBITMQ_NODE_PORT=5699 RABBITMQ_DIST_PORT=25699 \
//	RABBITMQ_MNESIA_BASE=/tmp/rrflow/mnesia RABBITMQ_LOG_BASE=/tmp/rrflow/log \
//	RABBITMQ_PID_FILE=/tmp/rrflow/pid RABBITMQ_CONFIG_FILE=/tmp/rrflow/rabbitmq \
//	rabbitmq-server -detached
//	AMQP_URI=amqp://guest:guest@127.0.0.1:5699/ RABBITRETRY_CTL='rabbitmqctl -n rrflow@localhost' \
//	RABBITRETRY_FAULTS=1 go test -race -run TestFlowControl -v ./faults/
//	rabbitmqctl -n rrflow@localhost stop
//
// In CI (make test-faults) it runs against the suite's own broker alone.
// Then:
//
//   - a 64 MiB publish on a fresh publisher (ConfirmTimeout 3 s) must return
//     within its deadline, and a small publish on the connection's other
//     channel must not stay stuck behind it;
//   - a router with the retry chain consumes messages of which 20% fail
//     once or twice: every failed schedule must fail fast with
//     confirm.ErrBlocked (not hold the subscription for ConfirmTimeout),
//     and no healthy message is handled twice;
//
// then clears the alarm: everything drains, nothing is lost (ACCOUNT line).
// It asserts the publisher's invariants, not which way the chain settles a
// message whose retry could not be scheduled (fallback copy, requeue).
func TestFlowControl(t *testing.T) {
	requireDisruptive(t)
	haveRabbitmqctl(t)
	const confirmTimeout = 15 * time.Second
	// A blocked publish gives up after the publisher's grace (1 s); allow
	// as much again for scheduling on a busy machine. The point is: far
	// below ConfirmTimeout.
	const failFast = 3 * time.Second
	obs := newFlowObserver()
	e := newEnv(t, "classic", func(e *env, c *amqpretry.Config) {
		c.ConfirmTimeout = confirmTimeout
		c.Observer = obs
		c.FallbackPause = 100 * time.Millisecond
	})
	t.Cleanup(func() {
		if err := memoryAlarm(t, false); err != nil {
			t.Errorf("clearing the memory alarm: %v", err)
		}
	})
	e.declare()

	// Published before the alarm: the alarm blocks this test's publisher too.
	const n = 200
	uuids, ps := newMessages(n, nil)
	plan := transientPlan(uuids, 20, 5)
	healthy := 0
	for _, f := range plan {
		if f == 0 {
			healthy++
		}
	}
	e.publish(ps...)

	if err := memoryAlarm(t, true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the memory alarm", func() bool { return memoryAlarmActive(t) })
	t.Log("memory alarm raised")

	// 1. Writes are bounded: a large copy cannot hold the send lock forever.
	t.Run("WriteBounded", func(t *testing.T) { checkBoundedWrites(t, e.uri) })

	// 2. The retry chain under the alarm.
	l := newLedger()
	h := planHandler(l, staticPlan(plan), 0, nil)
	e.start(func(msg *message.Message) error {
		err := h(msg)
		if err != nil {
			obs.handlerFailed(msg.UUID)
		}
		return err
	})
	// Enough failed schedules to judge; the chain's way of settling them
	// (pause, fallback copy, requeue) decides how fast the rest drains.
	const enough = 10
	failures := func() int { fs, _, _ := obs.snapshot(); return len(fs) }
	if !poll(2*time.Minute, func() bool { return failures() >= enough }) {
		t.Errorf("after 2 min under the alarm only %d failed schedules (%d/%d healthy handled)",
			failures(), l.handled(), healthy)
	}
	fs, scheduled, other := obs.snapshot()
	if scheduled != 0 {
		t.Errorf("%d retries scheduled while the broker blocks publishers", scheduled)
	}
	var blocked, slow int
	var longest time.Duration
	for _, f := range fs {
		longest = max(longest, f.took)
		if errors.Is(f.err, confirm.ErrBlocked) {
			blocked++
		} else {
			t.Errorf("schedule of %s failed with %v, want ErrBlocked", f.uuid, f.err)
		}
		if f.took > failFast {
			slow++
		}
	}
	t.Logf("while blocked: %d schedules failed (%d with ErrBlocked), longest %v; %d other failed copies; %d/%d healthy handled, %d/%d failing ones tried",
		len(fs), blocked, longest.Round(time.Millisecond), other, l.handled(), healthy, len(fs), n-healthy)
	if slow > 0 {
		t.Errorf("%d of %d failed schedules held the subscription longer than %v (longest %v; ConfirmTimeout %v)",
			slow, len(fs), failFast, longest, confirmTimeout)
	}
	if reason, ok := e.retry.Publisher().Blocked(); !ok {
		t.Errorf("publisher does not report the broker's block")
	} else {
		t.Logf("publisher reports blocked: %q", reason)
	}
	for u, c := range l.successes() {
		if plan[u] == 0 && c > 1 {
			t.Errorf("healthy message %s handled %d times", u, c)
		}
	}

	// 3. Clear the alarm: everything drains.
	if err := memoryAlarm(t, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the memory alarm to clear", func() bool { return !memoryAlarmActive(t) })
	t.Log("memory alarm cleared")
	settled := e.settle(n, l.handled, 3*time.Minute)
	e.stop()
	if _, ok := e.retry.Publisher().Blocked(); ok {
		t.Errorf("publisher still reports blocked after the alarm cleared")
	}
	poisoned, _ := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Errorf("messages did not settle within 3 min after the alarm cleared")
	}
	e.checkEmpty()
	if acc.Poisoned != 0 {
		// Not a publisher invariant: how the chain settles a message whose
		// retries could not be scheduled.
		t.Logf("%d messages poisoned (each fails at most twice with 5 attempts)", acc.Poisoned)
	}
	// A duplicate needs a copy whose outcome was unknown: written before the
	// block reached the publisher, given up after the grace, enqueued once
	// the broker unblocked. With one handler there is at most one publish
	// in flight when the block comes (once per publisher connection), so a
	// handful at most, never one per failing message (the old publisher
	// made 12 here).
	if acc.Duplicates > 5 {
		t.Errorf("%d duplicates for %d failing messages, want at most 5", acc.Duplicates, n-healthy)
	}
	for u, c := range l.successes() {
		if plan[u] == 0 && c > 1 {
			t.Errorf("healthy message %s handled %d times", u, c)
		}
	}
}

// checkBoundedWrites publishes 64 MiB on a fresh publisher while the broker
// blocks publishers (it stops reading the socket once the connection
// publishes), and a small message on the connection's other channel: both
// must return within the publisher's ConfirmTimeout plus a margin.
func checkBoundedWrites(t *testing.T, uri string) {
	const timeout = 3 * time.Second
	const margin = 5 * time.Second
	p, err := confirm.New(confirm.Config{URI: uri, Channels: 2, ConfirmTimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		closed := make(chan error, 1)
		go func() { closed <- p.Close() }()
		select {
		case <-closed:
		case <-time.After(timeout + margin + 5*time.Second):
			t.Errorf("Close of the publisher still stuck")
		}
	}()
	key := uniquePrefix(t) + ".nowhere" // unroutable: nothing stays behind
	type result struct {
		err  error
		took time.Duration
	}
	publish := func(size int) <-chan result {
		ch := make(chan result, 1)
		go func() {
			start := time.Now()
			err := p.PublishRaw(context.Background(), "", key, amqp.Publishing{Body: make([]byte, size)})
			ch <- result{err, time.Since(start)}
		}()
		return ch
	}
	// The 64 MiB message first: the broker reads its basic.publish, blocks
	// the connection (connection.blocked) and stops reading, so the rest of
	// the message is stuck in the socket write.
	big := publish(64 << 20)
	if !poll(10*time.Second, func() bool { _, blocked := p.Blocked(); return blocked }) {
		t.Errorf("the publisher did not see connection.blocked within 10 s")
	}
	// While that write is stuck, another publish on the other channel.
	small := publish(10)
	for _, c := range []struct {
		name string
		ch   <-chan result
		want error
	}{
		{"64 MiB publish", big, confirm.ErrWriteTimeout},
		{"small publish", small, confirm.ErrBlocked},
	} {
		select {
		case r := <-c.ch:
			t.Logf("%s returned after %v: %v", c.name, r.took.Round(time.Millisecond), r.err)
			if !errors.Is(r.err, c.want) {
				t.Errorf("%s: %v, want %v", c.name, r.err, c.want)
			}
		case <-time.After(timeout + margin):
			t.Errorf("%s still stuck %v after it started (ConfirmTimeout %v): a write is stuck past its deadline", c.name, timeout+margin, timeout)
		}
	}
	// The publisher stays usable: it fails fast while blocked.
	next := publish(1)
	select {
	case r := <-next:
		t.Logf("next publish returned after %v: %v", r.took.Round(time.Millisecond), r.err)
		if r.err == nil {
			t.Errorf("publish after the stuck write succeeded while the broker blocks publishers")
		}
	case <-time.After(timeout + margin):
		t.Errorf("publish after the stuck write still stuck after %v", timeout+margin)
	}
}
