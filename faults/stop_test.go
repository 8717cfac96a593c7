package faults

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// Issue 18 item 11. The router stops the Watermill way: Retry.NewSubscriber
// (the draining subscriber) with Watermill's defaults (Router CloseTimeout
// 30 s, drain timeout 20 s), stopped by cancelling Run's context, by
// Router.Close alone, or by both. Run returns within the drain time of what is in
// flight: at once when idle, after the handler in flight mid-storm, and the
// stop poisons nothing and re-runs no success. Before, cancelling the
// context never stopped the router (the draining subscriber detached its
// subscription from the router's context), and a Close could wait the full
// CloseTimeout with nothing in flight.
func TestStopTheWatermillWay(t *testing.T) {
	requireLong(t)
	for _, how := range []string{"context", "close", "context+close"} {
		t.Run(how+"/idle", func(t *testing.T) { testStop(t, how, 0) })
		t.Run(how+"/storm", func(t *testing.T) { testStop(t, how, 100) })
	}
}

// stopBound is how long Run may take to return once stopped: the in-flight
// handler's work (slowWork) plus broker round trips, with room for CI load;
// far below the drain timeout (20 s) and CloseTimeout (30 s).
const stopBound = 5 * time.Second

// In a storm, the slowRun-th handler run takes slowWork; the router is
// stopped while it runs.
const (
	slowRun  = 30
	slowWork = time.Second
)

func testStop(t *testing.T, how string, n int) {
	e := newEnv(t, "classic")
	l := newLedger()
	uuids, ps := newMessages(n, nil)
	var runs, ctxErrs atomic.Int32
	slowEntered := make(chan struct{})
	handler := func(msg *message.Message) error {
		r := runs.Add(1)
		a := middleware.Attempt(msg)
		l.attempt(msg.UUID, a)
		if r == slowRun {
			// The message in flight when the router stops: it finishes, with
			// its context intact, and is acked.
			close(slowEntered)
			time.Sleep(slowWork)
			if msg.Context().Err() != nil {
				ctxErrs.Add(1)
				return msg.Context().Err()
			}
			l.success(msg.UUID)
			return nil
		}
		time.Sleep(10 * time.Millisecond) // the handler's work
		if a == 1 && len(msg.UUID)%2 == 0 {
			return errTransient // a retry storm: about half fail their first attempt
		}
		l.success(msg.UUID)
		return nil
	}
	e.declare()
	sub, err := e.retry.NewSubscriber(e.logs.named("subscriber"), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	rt, err := message.NewRouter(message.RouterConfig{}, e.logs.named("router"))
	if err != nil {
		t.Fatal(err)
	}
	rt.AddMiddleware(e.retry.Middleware)
	rt.AddConsumerHandler("svc", e.queue, sub, handler)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- rt.Run(ctx) }()
	select {
	case <-rt.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	}
	if n > 0 {
		e.publish(ps...)
		select {
		case <-slowEntered:
		case <-time.After(30 * time.Second):
			t.Fatal("the storm did not reach its slow message")
		}
	}

	start := time.Now()
	closed := make(chan error, 1)
	switch how {
	case "context":
		cancel()
	case "close":
		go func() { closed <- rt.Close() }()
	case "context+close":
		cancel()
		go func() { closed <- rt.Close() }()
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(stopBound):
		t.Errorf("Run did not return within %v of the stop (%s)", stopBound, how)
		// Unblock it the only way today's code allows.
		_ = rt.Close()
		_ = sub.Close()
		<-done
	}
	took := time.Since(start)
	if how != "context" {
		if err := <-closed; err != nil {
			t.Errorf("Router.Close: %v", err)
		}
	}
	if err := sub.Close(); err != nil {
		t.Errorf("subscriber Close: %v", err)
	}
	t.Logf("stopped by %s in %v with %d handler runs before", how, took.Round(time.Millisecond), runs.Load())
	if took > stopBound {
		t.Errorf("stop took %v, more than %v", took, stopBound)
	}
	if ctxErrs.Load() != 0 {
		t.Errorf("the handler in flight saw its context cancelled by the stop")
	}
	if got := e.logs.find("", "Message poisoned"); len(got) != 0 {
		t.Errorf("poisoned by the stop: %v", got[0].Fields)
	}
	if n == 0 {
		return
	}

	// A new router finishes the storm; nothing was lost, poisoned or re-run.
	e.start(func(msg *message.Message) error { return handler(msg) })
	settled := e.settle(n, l.handled, 60*time.Second)
	e.stop()
	poisoned, _ := e.poisoned()
	acc := account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	if acc.Handled != n || acc.Poisoned != 0 || acc.Duplicates != 0 {
		t.Errorf("want all %d handled once, none poisoned", n)
	}
	for _, u := range uuids {
		if as := l.attemptsOf(u); len(as) > 2 {
			t.Errorf("%s ran %d times (%v), want at most 2", u, len(as), fmt.Sprint(as))
		}
	}
}
