package amqpretry

import (
	"context"
	"errors"
	"testing"
	"time"
)

// lazyDeadlineCtx behaves as context.WithDeadline: Deadline without a
// timer, Done and Err at the deadline, a child cancelled with it, Cause,
// the earlier parent deadline, and stop.
func TestLazyDeadlineCtx(t *testing.T) {
	type key struct{}
	parent := context.WithValue(context.Background(), key{}, "v")
	dl := time.Now().Add(50 * time.Millisecond)
	c := newLazyDeadline(dl)
	c.Context = parent
	if d, ok := c.Deadline(); !ok || !d.Equal(dl) {
		t.Errorf("Deadline %v %v, want %v", d, ok, dl)
	}
	if c.Value(key{}) != "v" {
		t.Errorf("Value lost the parent's")
	}
	if c.inner.Load() != nil {
		t.Fatalf("Deadline/Value made the timer")
	}
	child, cancelChild := context.WithCancel(c)
	defer cancelChild()
	if c.Err() != nil {
		t.Errorf("Err before the deadline: %v", c.Err())
	}
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("child not cancelled at the deadline")
	}
	if !errors.Is(c.Err(), context.DeadlineExceeded) || !errors.Is(child.Err(), context.DeadlineExceeded) {
		t.Errorf("Err %v / child %v, want DeadlineExceeded", c.Err(), child.Err())
	}
	if !errors.Is(context.Cause(c), context.DeadlineExceeded) {
		t.Errorf("Cause %v", context.Cause(c))
	}
	c.stop()

	// The parent's earlier deadline wins, as with context.WithDeadline.
	early := time.Now().Add(time.Minute)
	p2, cancelP2 := context.WithDeadline(context.Background(), early)
	defer cancelP2()
	c2 := newLazyDeadline(early.Add(time.Hour))
	c2.Context = p2
	if d, _ := c2.Deadline(); !d.Equal(early) {
		t.Errorf("Deadline %v, want the parent's %v", d, early)
	}

	// stopped before anyone looked: done, Canceled, without a timer.
	c3 := newLazyDeadline(time.Now().Add(time.Hour))
	c3.Context = context.Background()
	c3.stop()
	if c3.inner.Load() != nil {
		t.Errorf("stop made the timer")
	}
	select {
	case <-c3.Done():
	default:
		t.Errorf("not done after stop")
	}
	if !errors.Is(c3.Err(), context.Canceled) {
		t.Errorf("Err after stop %v, want Canceled", c3.Err())
	}

	// stopped after the handler looked: its context is cancelled.
	c4 := newLazyDeadline(time.Now().Add(time.Hour))
	c4.Context = context.Background()
	done := c4.Done()
	c4.stop()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed by stop")
	}
}
