package middleware_test

import (
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

func jitterBackoff(initial time.Duration, factor float64) func() backoff.BackOff {
	return func() backoff.BackOff {
		b := backoff.NewExponentialBackOff()
		b.InitialInterval = initial
		b.Multiplier = 2
		b.RandomizationFactor = factor
		b.MaxInterval = time.Hour
		b.MaxElapsedTime = 0
		return b
	}
}

func TestBackoffDelayDeterministic(t *testing.T) {
	policy := exactBackoff(100 * time.Millisecond)
	want := []time.Duration{100, 200, 400, 800, 1600, 3200}
	for i, w := range want {
		d, ok := retrymeta.BackoffDelay(policy, i+1)
		if !ok || d != w*time.Millisecond {
			t.Errorf("BackoffDelay(n=%d) = %v, %v; want %v", i+1, d, ok, w*time.Millisecond)
		}
	}
	// n < 1 reads as 1.
	for _, n := range []int{0, -3} {
		if d, ok := retrymeta.BackoffDelay(policy, n); !ok || d != 100*time.Millisecond {
			t.Errorf("BackoffDelay(n=%d) = %v, %v; want 100ms", n, d, ok)
		}
	}
	// The cap applies.
	capped := func() backoff.BackOff {
		b := exactBackoff(100 * time.Millisecond)().(*backoff.ExponentialBackOff)
		b.MaxInterval = 300 * time.Millisecond
		return b
	}
	if d, _ := retrymeta.BackoffDelay(capped, 5); d != 300*time.Millisecond {
		t.Errorf("capped delay %v, want 300ms", d)
	}
}

// The same n gives the same delay however many goroutines compute delays at
// once: no state is shared between calls.
func TestBackoffDelayDependsOnlyOnN(t *testing.T) {
	policy := exactBackoff(10 * time.Millisecond)
	jittered := jitterBackoff(10*time.Millisecond, 0.5)
	var wg sync.WaitGroup
	errs := make(chan string, 1000)
	for g := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				n := (g+i)%8 + 1
				want := 10 * time.Millisecond << (n - 1)
				if d, ok := retrymeta.BackoffDelay(policy, n); !ok || d != want {
					errs <- "exact delay wrong"
					return
				}
				if d, ok := retrymeta.BackoffDelay(jittered, n); !ok || d < want/2 || d > want*3/2 {
					errs <- "jittered delay out of bounds"
					return
				}
				if d, ok := retrymeta.BackoffDelay(retrymeta.DefaultBackoff, n); !ok || d < time.Second<<(n-1)/2 || d > time.Second<<(n-1)*3/2 {
					errs <- "default delay out of bounds"
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

func TestBackoffDelayJitterBounds(t *testing.T) {
	policy := jitterBackoff(100*time.Millisecond, 0.5)
	for _, n := range []int{1, 3} {
		center := 100 * time.Millisecond << (n - 1)
		lo, hi := center/2, center*3/2
		minSeen, maxSeen := time.Duration(1<<62), time.Duration(0)
		for range 2000 {
			d, ok := retrymeta.BackoffDelay(policy, n)
			if !ok {
				t.Fatal("policy stopped")
			}
			if d < lo || d > hi {
				t.Fatalf("n=%d: delay %v outside [%v, %v]", n, d, lo, hi)
			}
			minSeen, maxSeen = min(minSeen, d), max(maxSeen, d)
		}
		// With 2000 uniform samples the extremes come close to the bounds;
		// a policy without jitter would sit at the centre.
		if minSeen > center*6/10 || maxSeen < center*14/10 {
			t.Errorf("n=%d: samples span only [%v, %v] of [%v, %v]", n, minSeen, maxSeen, lo, hi)
		}
	}
}

func TestDefaultBackoff(t *testing.T) {
	b := retrymeta.DefaultBackoff().(*backoff.ExponentialBackOff)
	if b.InitialInterval != time.Second || b.Multiplier != 2 || b.RandomizationFactor != 0.5 || b.MaxInterval != 5*time.Minute || b.MaxElapsedTime != 0 {
		t.Fatalf("unexpected default policy %+v", b)
	}
	// Far attempts stay within the 5 min cap (+50% jitter).
	d, ok := retrymeta.BackoffDelay(retrymeta.DefaultBackoff, 30)
	if !ok || d < 150*time.Second || d > 450*time.Second {
		t.Fatalf("delay after attempt 30: %v, %v", d, ok)
	}
}

func TestBackoffDelayStop(t *testing.T) {
	if d, ok := retrymeta.BackoffDelay(func() backoff.BackOff { return &backoff.StopBackOff{} }, 1); ok || d != 0 {
		t.Errorf("StopBackOff: %v, %v; want 0, false", d, ok)
	}
	limited := func() backoff.BackOff {
		return backoff.WithMaxRetries(backoff.NewConstantBackOff(30*time.Millisecond), 2)
	}
	for n, wantOK := range map[int]bool{1: true, 2: true, 3: false, 10: false} {
		d, ok := retrymeta.BackoffDelay(limited, n)
		if ok != wantOK || (ok && d != 30*time.Millisecond) || (!ok && d != 0) {
			t.Errorf("WithMaxRetries(2) n=%d: %v, %v; want ok=%v", n, d, ok, wantOK)
		}
	}
}

func TestFormatDelay(t *testing.T) {
	cases := map[time.Duration]string{
		250 * time.Millisecond: "250ms", time.Second: "1s", 90 * time.Second: "90s", 5 * time.Minute: "5m",
		2 * time.Hour: "2h", 1500 * time.Millisecond: "1500ms", time.Millisecond: "1ms", -time.Second: "0ms",
	}
	for d, want := range cases {
		if got := retrymeta.FormatDelay(d); got != want {
			t.Errorf("FormatDelay(%v) = %q, want %q", d, got, want)
		}
	}
}

var exactBackoff = testkit.ExactBackoff
