package faults

import (
	"context"
	"errors"
	"math/rand/v2"
	"os/exec"
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
	t.Logf("broker app restarted (stop %v, total %v)", stopped.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
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
		t.Logf("before the restarts: %v retries waiting (wait queues, or failed and not yet handled), %v messages handled", inFlight, handledAt)
		if inFlight[0]+inFlight[1] == 0 || handledAt[1] >= n {
			t.Errorf("the restarts did not hit the storm (waiting %v, handled %v)", inFlight, handledAt)
		}

		settled := e.settle(n, l.handled, 3*time.Minute)
		e.stop()
		poisoned, _ := e.poisoned()
		acc := account(t, uuids, l.successes(), poisoned)
		reportPhantoms(t, l)
		if !settled {
			t.Errorf("messages did not settle within 3 min")
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
