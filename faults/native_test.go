package faults

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

// brokerAtLeast43 reports whether the broker under test is RabbitMQ 4.3 or
// later (RABBITRETRY_BROKER_VERSION, set by scripts/brokers.sh env).
func brokerAtLeast43() bool {
	var major, minor int
	if _, err := fmt.Sscanf(os.Getenv("RABBITRETRY_BROKER_VERSION"), "%d.%d", &major, &minor); err != nil {
		return false
	}
	return major > 4 || major == 4 && minor >= 3
}

// Native delayed retry (RabbitMQ 4.3 quorum queues): a storm (30 % of the
// messages fail once or twice) whose retries all wait in Q's delayed state
// (Min 200 ms, Max 400 ms: the backoff gives 200 and 400 ms), while the broker closes the
// consumer's connection twice mid-run. The unacked deliveries come back
// delayed too (x-delayed-retry-type all), counted as attempts by
// x-acquired-count: MaxAttempts 8 leaves room for the crashes. Nothing is
// lost, nothing waits in a wait queue.
func TestNativeDelayedRetryConnectionDrop(t *testing.T) {
	if !brokerAtLeast43() {
		t.Skip("native delayed retry needs RabbitMQ 4.3+ (RABBITRETRY_BROKER_VERSION)")
	}
	haveRabbitmqctl(t)
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
		c.MaxAttempts = 8
		c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: 200 * time.Millisecond, Max: 400 * time.Millisecond, Tiers: envTiers})
	})
	acc, _ := runStorm(t, e, storm{pause: 150 * time.Millisecond, work: 4 * time.Millisecond, allowPhantoms: true}, func(*ledger) {
		dropSubscriberConnection(t, e, 2)
	})
	if acc.Lost != 0 {
		t.Errorf("lost %d", acc.Lost)
	}
	if n := len(e.logs.find("info", "Retry by native delayed retry")); n == 0 {
		t.Errorf("no native retries logged")
	}
	if es := e.logs.find("info", "Retry scheduled"); len(es) != 0 {
		t.Errorf("%d retries went to a wait queue; every delay is in the native range (first: %v)", len(es), es[0])
	}
}

// nativeEnv is a quorum-queue env in the native delayed retry mode: the
// backoff (200, 400 ms) fits Min 200 ms / Max 400 ms, so every retry waits
// in Q's delayed state. MaxAttempts 8 leaves room for the attempts a crash
// or a connection loss uses (each return of an unacked delivery counts,
// x-acquired-count).
func nativeEnv(t *testing.T) *env {
	t.Helper()
	if !brokerAtLeast43() {
		t.Skip("native delayed retry needs RabbitMQ 4.3+ (RABBITRETRY_BROKER_VERSION)")
	}
	return newEnv(t, amqpretry.QueueTypeQuorum, func(_ *env, c *amqpretry.Config) {
		c.MaxAttempts = 8
		c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: 200 * time.Millisecond, Max: 400 * time.Millisecond, Tiers: envTiers})
	})
}

// TestBrokerRestartMidStorm with native delayed retry: the broker app
// restarts twice while retries are held in Q's delayed state (a quorum
// queue's Raft log keeps them); every message ends handled, none poisoned.
func TestNativeDelayedRetryBrokerRestartMidStorm(t *testing.T) {
	requireDisruptive(t)
	haveRabbitmqctl(t)
	e := nativeEnv(t)
	restartMidStorm(t, e)
	if es := e.logs.find("info", "Retry scheduled"); len(es) != 0 {
		t.Errorf("%d retries went to a wait queue; every delay is in the native range", len(es))
	}
}

// TestConsumerKilled with native delayed retry: the SIGKILLed consumer's
// unacked deliveries go back to Q delayed (x-delayed-retry-type all), the
// retries it had handed to the delayed state stay there; a second process
// takes over and every message is accounted for.
func TestNativeDelayedRetryConsumerKilled(t *testing.T) {
	e := nativeEnv(t)
	consumerKilled(t, e, "-max-attempts", "8", "-native-min", "200ms", "-native-max", "400ms")
}
