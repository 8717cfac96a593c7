package faults

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

var errTransient = errors.New("dependency unavailable")

func forEachQueueType(t *testing.T, f func(t *testing.T, queueType string)) {
	for _, qt := range []string{amqpretry.QueueTypeClassic, amqpretry.QueueTypeQuorum} {
		t.Run(qt, func(t *testing.T) { f(t, qt) })
	}
}

// transientPlan gives each UUID a number of transient failures before it
// succeeds: percent% of them fail once or twice, the others never.
func transientPlan(uuids []string, percent int, seed uint64) map[string]int {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	plan := make(map[string]int, len(uuids))
	for _, u := range uuids {
		if rng.IntN(100) < percent {
			plan[u] = 1 + rng.IntN(2)
		} else {
			plan[u] = 0
		}
	}
	return plan
}

// planHandler fails a message while its attempt number is within its plan,
// then records a success. A message that is not in the plan (never
// published: a phantom delivery) is recorded as such and gets phantomErr.
func planHandler(l *ledger, plan func(uuid string) (int, bool), work time.Duration, phantomErr error) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		failures, known := plan(msg.UUID)
		if !known {
			l.phantom(msg)
			return phantomErr
		}
		a := middleware.Attempt(msg)
		l.attempt(msg.UUID, a)
		if work > 0 {
			time.Sleep(work) // simulated work, keeps the storm going long enough to be interrupted
		}
		if a <= failures {
			return errTransient
		}
		l.success(msg.UUID)
		return nil
	}
}

func staticPlan(plan map[string]int) func(string) (int, bool) {
	return func(u string) (int, bool) { f, ok := plan[u]; return f, ok }
}

// reportPhantoms logs phantom deliveries (messages nobody published that
// reached the handler); see TestSubscriberConnectionDrop for the cause.
func reportPhantoms(t *testing.T, l *ledger) {
	t.Helper()
	if ph := l.phantomDeliveries(); len(ph) > 0 {
		t.Logf("PHANTOM deliveries reached the handler %d time(s) (acked, not republished here; see TestSubscriberConnectionDrop): %v", len(ph), ph[:min(len(ph), 5)])
	}
}

// restartBrokerApp stops and starts the RabbitMQ application (the Erlang
// node stays up): every connection is closed, durable queues and persistent
// messages are recovered.
func restartBrokerApp(t *testing.T) {
	t.Helper()
	start := time.Now()
	if _, err := rabbitmqctl(t, 2*time.Minute, "-q", "stop_app"); err != nil {
		t.Fatal(err)
	}
	stopped := time.Since(start)
	if _, err := rabbitmqctl(t, 3*time.Minute, "-q", "start_app"); err != nil {
		t.Fatal(err)
	}
	if _, err := rabbitmqctl(t, 3*time.Minute, "-q", "await_startup", "--timeout", "170"); err != nil {
		t.Fatal(err)
	}
	t.Logf("broker app restarted (stop_app from %s, %v; back at %s, total %v)", start.Format("15:04:05.000"),
		stopped.Round(time.Millisecond), time.Now().Format("15:04:05.000"), time.Since(start).Round(time.Millisecond))
}

// ensureBrokerApp starts the app if a failed test left it stopped.
func ensureBrokerApp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if exec.CommandContext(ctx, "rabbitmq-diagnostics", "-q", "check_running").Run() == nil {
		return
	}
	if _, err := rabbitmqctl(t, 3*time.Minute, "-q", "start_app"); err != nil {
		t.Errorf("could not restart the broker app: %v (run scripts/ensure-broker.sh)", err)
		return
	}
	_, _ = rabbitmqctl(t, 3*time.Minute, "-q", "await_startup", "--timeout", "170")
}

// restartSettleBound is how long a restart test waits for every message
// to complete. A quorum wait queue dead-letters at-least-once: a message it
// dead-lettered while the broker stopped, whose confirm never came, is
// sent again when dead_letter_worker_publisher_confirm_timeout runs out
// (180 s by default; rabbit_fifo_dlx_worker), so a retry can come back up
// to 3 min late (never lost).
const restartSettleBound = 4 * time.Minute

// lostInClassicDeadLettering explains a lost message (accountExplained)
// when RabbitMQ's classic dead-lettering, which is at-most-once, is the
// only place it can have been lost: e's wait queues are classic, and the
// last thing that happened to it is a retry copy the broker confirmed into
// a wait queue before the last restart (the last log entry about it is
// "Retry scheduled", for its last handler attempt). After that confirm the
// copy is the broker's until its TTL dead-letters it into Q; a dead-letter
// published while the broker stops can be dropped (docs/reliability.md).
// nil for quorum wait queues: there every loss fails the test.
func (e *env) lostInClassicDeadLettering(l *ledger, lastRestart time.Time) func(uuid string) string {
	if e.queueType != amqpretry.QueueTypeClassic || e.native() {
		return nil
	}
	return func(uuid string) string {
		last, ok := e.logs.last(uuid)
		attempts := l.attemptsOf(uuid)
		if !ok || last.Msg != "Retry scheduled" || !last.At.Before(lastRestart) || len(attempts) == 0 ||
			fmt.Sprint(last.Fields["attempt"]) != fmt.Sprint(attempts[len(attempts)-1]) {
			return ""
		}
		return "dropped by RabbitMQ's at-most-once classic dead-lettering: confirmed into a wait queue, never dead-lettered back"
	}
}

// 2,000 persistent messages, 30% failing transiently once or twice; the
// broker app is restarted twice while retries wait in the wait queues. The
// watermill-amqp subscriber reconnects and redeclares the topology, the
// confirm.Publisher redials on its next publish, and every message ends
// handled (at-least-once: duplicates are counted, not failures).
func TestBrokerRestartMidStorm(t *testing.T) {
	requireDisruptive(t)
	haveRabbitmqctl(t)
	forEachQueueType(t, func(t *testing.T, qt string) { restartMidStorm(t, newEnv(t, qt)) })
}

// restartMidStorm runs the restart scenario on e. Retries in flight at each
// restart are counted in the wait queues, or, with NativeDelayedRetry (no
// wait queues), as messages that failed and have not succeeded yet.
func restartMidStorm(t *testing.T, e *env) {
	{
		t.Cleanup(func() { ensureBrokerApp(t) })
		const n = 2000
		uuids, ps := newMessages(n, nil)
		plan := transientPlan(uuids, 30, 1)
		l := newLedger()
		e.declare()
		e.publish(ps...)
		e.start(planHandler(l, staticPlan(plan), 2*time.Millisecond, nil))

		waitingAt := func() int {
			if e.native() {
				return l.awaitingRetry()
			}
			sum := 0
			for _, wq := range e.waitQueues() {
				sum += max(e.depth(wq), 0)
			}
			return sum
		}
		progress := func(min int) {
			t.Helper()
			waitFor(t, 2*time.Minute, "storm progress", func() bool { return l.handled() >= min })
		}
		progress(n / 5)
		inFlight := []int{waitingAt()}
		handledAt := []int{l.handled()}
		restartBrokerApp(t)
		progress(min(l.handled()+n/5, n-n/10))
		inFlight = append(inFlight, waitingAt())
		handledAt = append(handledAt, l.handled())
		restartBrokerApp(t)
		lastRestart := time.Now()
		t.Logf("before the restarts: %v retries waiting (wait queues, or failed and not yet handled), %v messages handled", inFlight, handledAt)
		// The first restart must hit the storm. The second may find it over:
		// on the cluster only one node restarts, and the consumer, connected
		// through the load balancer to another node, keeps going (seen: all
		// 2,000 handled during a 12.5 s first restart).
		if inFlight[0]+inFlight[1] == 0 || handledAt[0] >= n {
			t.Errorf("the restarts did not hit the storm (waiting %v, handled %v)", inFlight, handledAt)
		}

		// Complete: handled, or (classic wait queues) gone where only the
		// broker's dead-lettering can have dropped it, with every queue
		// quiet (settle).
		explain := e.lostInClassicDeadLettering(l, lastRestart)
		completed := l.handled
		if explain != nil {
			completed = func() int {
				ok, c := l.successes(), 0
				for _, u := range uuids {
					if ok[u] > 0 || explain(u) != "" {
						c++
					}
				}
				return c
			}
		}
		settled := e.settle(n, completed, restartSettleBound)
		e.stop()
		poisoned, _ := e.poisoned()
		acc := accountExplained(t, uuids, l.successes(), poisoned, explain)
		reportPhantoms(t, l)
		for _, u := range acc.LostUUIDs {
			t.Logf("lost %s: handler attempts %v; log trail:\n  %s", u, l.attemptsOf(u), strings.Join(e.logs.trail(u), "\n  "))
		}
		if !settled {
			t.Errorf("messages did not settle within %v", restartSettleBound)
		}
		e.checkEmpty()
		if acc.Poisoned != 0 {
			t.Errorf("%d messages poisoned; each fails at most twice with 5 attempts", acc.Poisoned)
		}
		// On a cluster only one node's app restarts (RABBITRETRY_CTL's node);
		// the subscriber may be connected, through the load balancer, to
		// another node and keep its connection. The cluster's own node faults
		// are in cluster_test.go.
		if got := len(e.logs.find("error", "Received close notification from AMQP, reconnecting")); got == 0 && testkit.Broker() != "cluster" {
			t.Errorf("the subscriber never logged a reconnect")
		}
	}
}
