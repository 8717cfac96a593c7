package faults

import (
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// pauseCounter is a middleware.PauseObserver counting transitions.
type pauseCounter struct{ started, ended atomic.Int64 }

func (p *pauseCounter) PauseStarted(string)      { p.started.Add(1) }
func (p *pauseCounter) PauseEnded(time.Duration) { p.ended.Add(1) }

// TestPauseOnDependencyOutage: 2,000 messages, the handler's dependency down
// for 30 s (RABBITRETRY_PAUSE_OUTAGE overrides) and then back. With the
// Pause on: nothing poisoned, at most one attempt charged per message (none,
// since every outage error is marked), lost 0, and consumption resumes within
// 2 s of the recovery. Long: RABBITRETRY_FAULTS=1.
func TestPauseOnDependencyOutage(t *testing.T) {
	requireDisruptive(t)
	outage := 30 * time.Second
	if v := os.Getenv("RABBITRETRY_PAUSE_OUTAGE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatal(err)
		}
		outage = d
	}
	for _, qt := range []string{"classic", "quorum"} {
		t.Run(qt, func(t *testing.T) {
			pc := &pauseCounter{}
			e := newEnv(t, qt, func(_ *env, c *amqpretry.Config) {
				c.MaxAttempts = 3
				c.Pause = &middleware.PauseConfig{ProbeInterval: 250 * time.Millisecond, MaxProbeInterval: time.Second, Observer: pc}
			})
			var down atomic.Bool
			down.Store(true)
			l := newLedger()
			var mu sync.Mutex
			var recoveredAt, firstAfter time.Time
			var outageRuns atomic.Int64
			e.start(func(msg *message.Message) error {
				l.attempt(msg.UUID, middleware.Attempt(msg))
				if down.Load() {
					outageRuns.Add(1)
					return middleware.DependencyUnavailable(errors.New("payment gateway: connection refused"))
				}
				mu.Lock()
				if firstAfter.IsZero() {
					firstAfter = time.Now()
				}
				mu.Unlock()
				l.success(msg.UUID)
				return nil
			})
			const n = 2000
			uuids, ps := newMessages(n, nil)
			start := time.Now()
			e.publish(ps...)
			waitFor(t, 10*time.Second, "pause", func() bool { return pc.started.Load() == 1 })
			time.Sleep(time.Until(start.Add(outage))) // the outage's length, not a synchronisation
			mu.Lock()
			recoveredAt = time.Now()
			mu.Unlock()
			down.Store(false)
			waitFor(t, 2*time.Minute, "all handled", func() bool { return l.handled() == n })
			mu.Lock()
			resumeIn := firstAfter.Sub(recoveredAt)
			mu.Unlock()
			if !e.settle(n, l.handled, time.Minute) {
				t.Error("queues did not settle")
			}
			poisoned, _ := e.poisoned()
			a := account(t, uuids, l.successes(), poisoned)
			if a.Poisoned != 0 {
				t.Errorf("poisoned %d, want 0", a.Poisoned)
			}
			maxCharged := 0
			for _, u := range uuids {
				for _, at := range l.attemptsOf(u) {
					maxCharged = max(maxCharged, at-1)
				}
			}
			if maxCharged > 1 {
				t.Errorf("a message was charged %d attempts for the outage, want at most 1", maxCharged)
			}
			if resumeIn > 2*time.Second {
				t.Errorf("consumption resumed %v after the recovery, want within 2 s", resumeIn)
			}
			t.Logf("outage %v: %d handler runs during it (probes and in-flight), pause started %d / ended %d, resumed %v after recovery, most attempts charged %d",
				outage, outageRuns.Load(), pc.started.Load(), pc.ended.Load(), resumeIn.Round(time.Millisecond), maxCharged)
		})
	}
}
