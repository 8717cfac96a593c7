package amqpretry_test

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// broker43 skips the test unless the broker under test is RabbitMQ 4.3 or
// later (RABBITRETRY_BROKER_VERSION, set by `eval "$(scripts/brokers.sh env 43)"`).
func broker43(t *testing.T) {
	t.Helper()
	v := os.Getenv("RABBITRETRY_BROKER_VERSION")
	var major, minor int
	if _, err := fmt.Sscanf(v, "%d.%d", &major, &minor); err != nil || major < 4 || (major == 4 && minor < 3) {
		t.Skipf("native delayed retry needs RabbitMQ 4.3+ (RABBITRETRY_BROKER_VERSION=%q)", v)
	}
}

// seqBackoff returns ds[0], ds[1], ... and then the last one forever.
type seqBackoff struct {
	ds []time.Duration
	i  int
}

func (s *seqBackoff) NextBackOff() time.Duration {
	d := s.ds[min(s.i, len(s.ds)-1)]
	s.i++
	return d
}
func (s *seqBackoff) Reset() { s.i = 0 }

// Native delayed retry on a 4.3 quorum queue: the first retries wait in Q
// itself (nack with requeue, x-delayed-retry-min), counted by
// x-acquired-count, with no copy in a wait queue and no failure metadata; a
// computed delay above Max takes the wait queue; the last attempt is
// poisoned with the full metadata; no message runs more than MaxAttempts.
func TestE2E_NativeDelayedRetry(t *testing.T) {
	broker43(t)
	const minDelay = 300 * time.Millisecond
	native := amqpretry.NativeDelayedRetry{Min: minDelay, Max: time.Second}
	e := newEnv(t, amqpretry.QueueTypeQuorum, func(c *amqpretry.Config) {
		c.MaxAttempts = 4
		// Attempts 1 and 2: 300 ms (native); attempt 3: 2 s (> Max: wait queue).
		c.Backoff = func() backoff.BackOff {
			return &seqBackoff{ds: []time.Duration{minDelay, minDelay, 2 * time.Second}}
		}
		c.Mode = amqpretry.NativeDelayed(native)
	})
	rec := newRecorder()
	okUUID := watermill.NewUUID()
	badUUID := watermill.NewUUID()
	q := e.handle("a", func(msg *message.Message) error {
		n := middleware.Attempt(msg)
		rec.record(msg, n)
		if msg.UUID == okUUID && n >= 3 {
			return nil
		}
		return errTransient
	})
	e.start()
	e.publish(message.NewMessage(okUUID, []byte("ok")), message.NewMessage(badUUID, []byte("bad")))

	// The message that succeeds on attempt 3: only native retries.
	waitFor(t, 15*time.Second, "3 attempts of the good message", func() bool { return rec.count(okUUID) == 3 })
	attempts, times := rec.get(okUUID)
	if fmt.Sprint(attempts) != "[1 2 3]" {
		t.Fatalf("attempts %v, want [1 2 3]", attempts)
	}
	for i := 1; i < len(times); i++ {
		if gap := times[i].Sub(times[i-1]); gap < minDelay {
			t.Errorf("attempt %d came %v after attempt %d, earlier than Min %v", i+1, gap, i, minDelay)
		}
	}
	rec.mu.Lock()
	okMeta := rec.meta[okUUID]
	rec.mu.Unlock()
	for i, md := range okMeta[1:] {
		if md.Get(retrymeta.DeliveryRedeliveredKey) != "true" || md.Get(retrymeta.XAcquiredCountKey) != fmt.Sprint(i+1) {
			t.Errorf("attempt %d: redelivered=%q x-acquired-count=%q, want true and %d", i+2,
				md.Get(retrymeta.DeliveryRedeliveredKey), md.Get(retrymeta.XAcquiredCountKey), i+1)
		}
		if md.Get(middleware.LastErrorKey) != "" || md.Get(middleware.DelayKey) != "" {
			t.Errorf("attempt %d carries failure metadata after a native hop: %v", i+2, md)
		}
	}

	// The failing message: attempts 1, 2 native, 3 -> wait queue (2 s > Max), 4 -> poisoned.
	waitFor(t, 10*time.Second, "the failing message's third attempt", func() bool { return rec.count(badUUID) == 3 })
	waitFor(t, 5*time.Second, "the retry after attempt 3 in a wait queue", func() bool {
		n := 0
		for _, wq := range e.retry.Topology().WaitQueues(q) {
			n += e.depth(wq)
		}
		return n == 1
	})
	pq := e.retry.Topology().Naming().PoisonQueue(q)
	waitFor(t, 15*time.Second, "the failing message poisoned", func() bool { return e.depth(pq) == 1 })
	time.Sleep(2 * minDelay) // nothing more may run
	badAttempts, badTimes := rec.get(badUUID)
	if fmt.Sprint(badAttempts) != "[1 2 3 4]" {
		t.Fatalf("failing message attempts %v, want [1 2 3 4] (never more than MaxAttempts)", badAttempts)
	}
	if gap := badTimes[3].Sub(badTimes[2]); gap < 2*time.Second {
		t.Errorf("attempt 4 came %v after attempt 3, earlier than the 2 s wait tier", gap)
	}
	rec.mu.Lock()
	fourth := rec.meta[badUUID][3]
	rec.mu.Unlock()
	if fourth.Get(retrymeta.DeliveryRedeliveredKey) != "" || fourth.Get(middleware.LastErrorKey) == "" {
		t.Errorf("attempt 4 (from the wait queue) should be a first delivery with failure metadata: %v", fourth)
	}
	ds := e.drain(pq)
	if len(ds) != 1 {
		t.Fatalf("%d messages in the poison queue, want 1", len(ds))
	}
	h := ds[0].Headers
	if h[middleware.PoisonAttemptsKey] != "4" || h[middleware.ErrorClassKey] != middleware.ClassTransient && h[middleware.ErrorClassKey] != "exhausted" ||
		h[middleware.LastErrorKey] == nil || h[middleware.FirstFailureKey] == nil || h[middleware.OriginalQueueKey] != q {
		t.Errorf("poison copy lacks the failure metadata: %v", h)
	}
	if _, ok := h[retrymeta.XAcquiredCountKey]; ok {
		t.Errorf("poison copy carries the broker's x-acquired-count: %v", h)
	}
	e.waitQueuesEmpty(q, 5*time.Second)
	if e.depth(q) != 0 {
		t.Errorf("Q not empty")
	}

	// An existing Q declared with other delayed-retry arguments: *DeclareError.
	cfg2 := amqpretry.Config{URI: e.uri, Subscriber: e.retry.SubscriberConfig(), QueueType: amqpretry.QueueTypeQuorum,
		Policy: router.Policy{MaxAttempts: 4}, Mode: amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: 500 * time.Millisecond, Max: time.Second})}
	r2, err := amqpretry.New(cfg2)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	err = r2.Topology().BuildTopology(ch, q, e.exchange, r2.SubscriberConfig(), watermill.NopLogger{})
	var de *amqpretry.DeclareError
	if !errors.As(err, &de) || !strings.Contains(err.Error(), "x-delayed-retry-min") {
		t.Errorf("redeclaring Q with another Min: err = %v, want a *DeclareError on x-delayed-retry-min", err)
	}
}

// New refuses the native mode on a broker older than 4.3 (which would
// accept the arguments and ignore them), saying what to use instead. Runs
// on whatever broker is under test; skipped on 4.3+.
func TestE2E_NativeDelayedRetryRefusedBefore43(t *testing.T) {
	uri := e2eURI(t)
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	v, _ := conn.Properties["version"].(string)
	_ = conn.Close()
	var major, minor int
	if _, err := fmt.Sscanf(v, "%d.%d", &major, &minor); err == nil && (major > 4 || major == 4 && minor >= 3) {
		t.Skipf("broker %s supports native delayed retry", v)
	}
	sub := wamqp.NewDurableQueueConfig(uri)
	_, err = amqpretry.New(amqpretry.Config{URI: uri, Subscriber: sub, QueueType: amqpretry.QueueTypeQuorum,
		Mode: amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: time.Second})})
	if err == nil || !strings.Contains(err.Error(), "4.3") || !strings.Contains(err.Error(), v) || !strings.Contains(err.Error(), "DeadLetterFirst") {
		t.Fatalf("New on RabbitMQ %s: err = %v, want a refusal naming 4.3, the version and the alternatives", v, err)
	}
}
