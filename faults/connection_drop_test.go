package faults

import (
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

// dropSubscriberConnection has the broker close the subscriber connection
// of e (found by its connection name and this process's ports) rounds
// times, waiting for watermill-amqp to reconnect and consume again in
// between.
func dropSubscriberConnection(t *testing.T, e *env, rounds int) {
	t.Helper()
	for round := 0; round < rounds; round++ {
		consuming := len(e.logs.find("info", "Starting consuming from AMQP channel"))
		closeSubscriberConnection(t, e)
		waitFor(t, 30*time.Second, "the subscriber to reconnect and consume again", func() bool {
			return len(e.logs.find("info", "Starting consuming from AMQP channel")) > consuming
		})
	}
}

// closeSubscriberConnection has the broker close e's subscriber connection,
// found by its connection name (unique to the test; behind a load balancer
// the broker sees the proxy's ports, not this process's).
func closeSubscriberConnection(t *testing.T, e *env) {
	t.Helper()
	closeNamedConnection(t, e.prefix+".subscriber")
}

// closeNamedConnection closes, through rabbitmqctl, the one connection
// named name (e.g. the quarantine subscription's, "<prefix>.subscriber.quarantine").
func closeNamedConnection(t *testing.T, name string) {
	t.Helper()
	var pids []string
	for _, c := range listConnections(t) {
		if c.Name == name {
			pids = append(pids, c.PID)
		}
	}
	if len(pids) != 1 {
		t.Fatalf("%d subscriber connections named %s, want 1", len(pids), name)
	}
	if _, err := rabbitmqctl(t, 30*time.Second, "close_connection", pids[0], "fault injection"); err != nil {
		t.Fatal(err)
	}
}

// The broker closes the consumer's connection four times during a storm
// (the handler is kept busy, so most closes hit a message mid-flight).
// watermill-amqp reconnects and redeclares the topology; unacked deliveries
// go back to the queue, confirmed retry copies wait in the wait queues;
// every published message ends handled.
//
// Phantom deliveries (see TestRetryCopyExceedsFrameMax) would be acked by
// this handler and only logged; none are expected.
func TestSubscriberConnectionDrop(t *testing.T) {
	requireLong(t)
	haveRabbitmqctl(t)
	e := newEnv(t, "classic")
	_, l := runStorm(t, e, storm{pause: 150 * time.Millisecond, work: 4 * time.Millisecond, allowPhantoms: true}, func(*ledger) {
		dropSubscriberConnection(t, e, 4)
	})
	reportPhantoms(t, l)
}

// A message that RabbitMQ delivers fine the first time could become
// undeliverable once retried: the producer's headers (here 130,500 bytes of a
// user header, legal under the negotiated frame_max of 131,072 bytes) grow on
// the retry path (the republisher's rabbitretry-* headers, then x-death added
// by the broker), and a delivery above frame_max makes amqp091-go close the
// consumer's connection, requeueing the message: an endless reconnect loop.
// Fixed: the AMQP Delayer refuses a copy above amqpwire.MaxCopyHeaderBytes
// with middleware.ErrCannotDelay, the message is poisoned (class
// "undelayable"), and the poison copy drops its largest user headers to fit.
//
// Also covered: the zero amqp.Delivery that watermill-amqp v2.1.3 can read
// from a closed deliveries channel (pkg/amqp/subscriber.go:317) is refused by
// amqpretry.Marshaler (an empty-delivery error) instead of reaching the handler as a
// phantom message.
func TestRetryCopyExceedsFrameMax(t *testing.T) {
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) { c.MaxAttempts = 3 })
	e.declare()
	uuids, ps := newMessages(10, nil)
	ps[0].Headers["big"] = strings.Repeat("h", 130500)
	plan := map[string]int{}
	for _, u := range uuids {
		plan[u] = 1
	}
	l := newLedger()
	e.start(planHandler(l, staticPlan(plan), 0, errTransient))
	e.publish(ps...)
	settled := e.settle(len(uuids), l.handled, 20*time.Second)
	e.stop()
	resets := len(e.logs.find("error", "Received close notification from AMQP, reconnecting"))
	poisoned, _ := e.poisoned()
	account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle within 20 s")
	}
	e.checkEmpty() // the "lost" ones are stuck in the queue, not destroyed
	if resets > 0 {
		t.Errorf("the consumer's connection was reset %d times (first: %v)", resets,
			e.logs.find("error", "Received close notification from AMQP, reconnecting")[0].Err)
	}
	if ph := l.phantomDeliveries(); len(ph) > 0 {
		t.Errorf("%d phantom deliveries reached the handler, e.g. %v", len(ph), ph[:min(3, len(ph))])
	}
	if n := poisoned[""]; n > 0 {
		t.Errorf("%d phantom message(s) (UUID \"\") were poisoned", n)
	}
	t.Logf("attempts of the big message: %v", l.attemptsOf(uuids[0]))
}
