package router_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/sony/gobreaker"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// pauseObs records pause transitions.
type pauseObs struct {
	recObserver
	started, ended atomic.Int64
}

func (o *pauseObs) PauseStarted(string)         { o.started.Add(1) }
func (o *pauseObs) PauseEnded(time.Duration)    { o.ended.Add(1) }
func (o *pauseObs) transitions() (int64, int64) { return o.started.Load(), o.ended.Load() }

// TestPause_DependencyOutageChargesNothing: while the handler's dependency
// is down (it returns DependencyUnavailable), nothing is retried or
// poisoned; when it is back, every message succeeds at attempt 1.
func TestPause_DependencyOutageChargesNothing(t *testing.T) {
	var down atomic.Bool
	down.Store(true)
	obs := &pauseObs{}
	var runs calls
	var mu sync.Mutex
	succeeded := map[string]int{}
	e := newEnv(t, router.Config{
		Policy: router.Policy{MaxAttempts: 3, Observer: obs, Pause: &middleware.PauseConfig{ProbeInterval: 20 * time.Millisecond, MaxProbeInterval: 50 * time.Millisecond}},
	}, func(msg *message.Message) ([]*message.Message, error) {
		runs.record(msg)
		if down.Load() {
			return nil, middleware.DependencyUnavailable(errors.New("payment gateway: connection refused"))
		}
		mu.Lock()
		succeeded[msg.UUID]++
		mu.Unlock()
		return nil, nil
	})
	const n = 50
	for i := 0; i < n; i++ {
		e.publish(t, message.NewMessage(fmt.Sprintf("m%d", i), nil))
	}
	waitFor(t, 5*time.Second, func() bool { s, _ := obs.transitions(); return s == 1 && runs.len() >= 3 })
	if s, en := obs.transitions(); s != 1 || en != 0 { // paused now: started, not ended
		t.Fatalf("not paused after a dependency error: %d pauses started, %d ended", s, en)
	}
	down.Store(false)
	waitFor(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(succeeded) == n })
	if got := obs.count("retry"); got != 0 {
		t.Errorf("%d retries scheduled during the outage, want 0", got)
	}
	if got := obs.count("poisoned"); got != 0 {
		t.Errorf("%d poisoned, want 0", got)
	}
	for _, c := range runs.get() {
		if c.attempt != 1 {
			t.Fatalf("message %s ran at attempt %d: an outage was charged", c.uuid, c.attempt)
		}
	}
	s, en := obs.transitions()
	if s != 1 || en != 1 {
		t.Errorf("pause started %d / ended %d times, want 1 / 1", s, en)
	}
	mu.Lock()
	defer mu.Unlock()
	for id, k := range succeeded {
		if k != 1 {
			t.Errorf("message %s succeeded %d times", id, k)
		}
	}
}

// TestPause_WatermillCircuitBreakerNotCounted: Watermill's CircuitBreaker
// (inside the chain) fails fast with gobreaker.ErrOpenState while open; the
// Pause treats that as an outage: no attempt is charged, nothing poisoned.
func TestPause_WatermillCircuitBreakerNotCounted(t *testing.T) {
	var down atomic.Bool
	down.Store(true)
	obs := &pauseObs{}
	var runs, work calls
	cb := wmw.NewCircuitBreaker(gobreaker.Settings{Name: "gateway", Timeout: 30 * time.Millisecond,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= 2 }})
	e := newEnv(t, router.Config{
		Policy: router.Policy{MaxAttempts: 2, Observer: obs, Pause: &middleware.PauseConfig{ProbeInterval: 10 * time.Millisecond, MaxProbeInterval: 40 * time.Millisecond}},
		// The breaker's own failures (before it opens) are transient
		// errors: the Pause counts them by failure rate only if asked.
	}, func(msg *message.Message) ([]*message.Message, error) {
		runs.record(msg)
		return nil, nil
	}, cb.Middleware, func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			work.record(msg)
			if down.Load() {
				return nil, middleware.DependencyUnavailable(errors.New("db down"))
			}
			return h(msg)
		}
	})
	const n = 20
	for i := 0; i < n; i++ {
		e.publish(t, message.NewMessage(fmt.Sprintf("cb%d", i), nil))
	}
	waitFor(t, 5*time.Second, func() bool { s, _ := obs.transitions(); return s >= 1 && work.len() >= 3 })
	down.Store(false)
	waitFor(t, 10*time.Second, func() bool { return runs.len() >= n })
	if got := obs.count("retry") + obs.count("poisoned"); got != 0 {
		t.Errorf("%d retries/poisonings, want 0", got)
	}
	if !middleware.IsDependencyOutage(fmt.Errorf("x: %w", gobreaker.ErrOpenState)) {
		t.Error("ErrOpenState is not an outage")
	}
}

// TestPause_FailureRate: generic transient errors trip the pause by rate;
// the failures before the trip are charged (one attempt each), none after.
func TestPause_FailureRate(t *testing.T) {
	var down atomic.Bool
	down.Store(true)
	obs := &pauseObs{}
	var runs calls
	var mu sync.Mutex
	ok := map[string]bool{}
	e := newEnv(t, router.Config{
		Policy: router.Policy{MaxAttempts: 5, Observer: obs, Backoff: exactBackoff(time.Hour), Pause: &middleware.PauseConfig{FailureRatio: 0.5, MinRequests: 5,
			ProbeInterval: 10 * time.Millisecond, MaxProbeInterval: 30 * time.Millisecond}},
	}, func(msg *message.Message) ([]*message.Message, error) {
		runs.record(msg)
		if string(msg.Payload) == "bad" {
			return nil, middleware.Permanent(errors.New("malformed order"))
		}
		if down.Load() {
			return nil, errTransient
		}
		mu.Lock()
		ok[msg.UUID] = true
		mu.Unlock()
		return nil, nil
	})
	const n = 30
	for i := 0; i < n; i++ {
		e.publish(t, message.NewMessage(fmt.Sprintf("r%d", i), nil))
	}
	waitFor(t, 5*time.Second, func() bool { s, _ := obs.transitions(); return s == 1 })
	charged := obs.count("retry")
	if charged < 4 || charged > 5 {
		t.Errorf("%d retries before the trip, want MinRequests-1 = 4 (the tripping run is held)", charged)
	}
	down.Store(false)
	waitFor(t, 10*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(ok) == n-charged })
	waitFor(t, 5*time.Second, func() bool { _, en := obs.transitions(); return en == 1 }) // resumed
	if got := obs.count("retry"); got != charged {
		t.Errorf("retries grew from %d to %d after the trip", charged, got)
	}
	// A permanent failure never counts toward the rate.
	e.publish(t, message.NewMessage("bad", []byte("bad")))
	waitFor(t, 5*time.Second, func() bool { return obs.count("poisoned") == 1 })
	if s, en := obs.transitions(); s != 1 || en != 1 { // the Pause told the observer before the poison forwarder ran
		t.Errorf("a permanent failure paused consumption: %d pauses started, %d ended", s, en)
	}
}

// TestPause_MaxHoldHandsBackUncharged: a message held longer than MaxHold
// goes back to its queue as a copy with the same attempt number.
func TestPause_MaxHoldHandsBackUncharged(t *testing.T) {
	obs := &pauseObs{}
	var runs calls
	var down atomic.Bool
	down.Store(true)
	e := newEnv(t, router.Config{
		Policy: router.Policy{MaxAttempts: 2, Observer: obs, Pause: &middleware.PauseConfig{ProbeInterval: 20 * time.Millisecond, MaxProbeInterval: 20 * time.Millisecond,
			MaxHold: 100 * time.Millisecond}},
	}, func(msg *message.Message) ([]*message.Message, error) {
		runs.record(msg)
		if down.Load() {
			return nil, middleware.DependencyUnavailable(errors.New("down"))
		}
		return nil, nil
	})
	e.publish(t, message.NewMessage("held", nil))
	// Held, handed back (a copy back in "orders" through the delayer), run
	// as a new delivery, held again...: the log shows each hand-back.
	waitFor(t, 5*time.Second, func() bool { return runs.len() >= 3 })
	down.Store(false)
	waitFor(t, 5*time.Second, func() bool { return obs.ended.Load() >= 1 })
	for _, c := range runs.get() {
		if c.attempt != 1 {
			t.Fatalf("run at attempt %d: the hold was charged", c.attempt)
		}
	}
	if got := obs.count("retry") + obs.count("poisoned"); got != 0 {
		t.Errorf("%d retries/poisonings, want 0", got)
	}
}

// TestPause_Validate names the bad field.
func TestPause_Validate(t *testing.T) {
	_, err := router.New(router.Config{Delayer: &fakeDelayer{}, PoisonPublisher: nopPublisher{},
		Policy: router.Policy{Pause: &middleware.PauseConfig{FailureRatio: 2}}})
	if err == nil || !strings.Contains(err.Error(), "FailureRatio") {
		t.Fatalf("err = %v, want FailureRatio named", err)
	}
}
