package middleware_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

func TestSetRemainingDelay(t *testing.T) {
	md := message.Metadata{}
	retrymeta.SetRemainingDelay(md, 1500*time.Microsecond)
	if got := md.Get(retrymeta.RemainingDelayKey); got != "2" {
		t.Errorf("1.5 ms written as %q, want 2 (rounded up)", got)
	}
	retrymeta.SetRemainingDelay(md, 0)
	if _, ok := md[retrymeta.RemainingDelayKey]; ok {
		t.Error("SetRemainingDelay(0) kept the key")
	}
	msg := message.NewMessage("u", nil)
	msg.Metadata.Set(retrymeta.RemainingDelayKey, "1100")
	if d := retrymeta.RemainingDelay(msg); d != 0 {
		t.Errorf("outside the retry path (a producer's header): %v, want 0", d)
	}
	msg.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true")
	for v, want := range map[string]time.Duration{"1100": 1100 * time.Millisecond, "0": 0, "-3": 0, "x": 0, "": 0} {
		msg.Metadata.Set(retrymeta.RemainingDelayKey, v)
		if d := retrymeta.RemainingDelay(msg); d != want {
			t.Errorf("RemainingDelay(%q) = %v, want %v", v, d, want)
		}
	}
	msg.Metadata.Set(retrymeta.RemainingDelayKey, "5")
	if _, ok := retrymeta.CloneMessage(msg).Metadata[retrymeta.RemainingDelayKey]; ok {
		t.Error("CloneMessage kept RemainingDelayKey")
	}
}

// A delivery that came back through the retry path before its delay was
// over is not run, not counted as a redelivery or an attempt: a copy goes
// to the Delayer for the remaining delay, as a minimum, copy required.
func TestRedeliveryGuardHoldsEarlyDelivery(t *testing.T) {
	d := &recordingDelayer{}
	g, err := middleware.NewRedeliveryGuard(middleware.RedeliveryGuardConfig{Delayer: d, MaxRedeliveries: 1})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil }
	for _, redelivered := range []bool{false, true} {
		msg := attemptMsg(2, "p")
		msg.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true")
		msg.Metadata.Set(retrymeta.RemainingDelayKey, "1100")
		msg.Metadata.Set(retrymeta.RedeliveriesKey, "1") // at the limit: a counted redelivery would poison
		if redelivered {
			msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
		}
		if _, err := g.Middleware(h)(msg); err != nil {
			t.Fatalf("redelivered %v: %v", redelivered, err)
		}
		calls := d.Calls()
		c := calls[len(calls)-1]
		minimum, _ := middleware.MinimumDelay(c.ctx)
		if c.delay != 1100*time.Millisecond || minimum != c.delay || !retrymeta.CopyRequired(c.ctx) {
			t.Errorf("redelivered %v: delay %v, minimum %v, copy required %v", redelivered, c.delay, minimum, retrymeta.CopyRequired(c.ctx))
		}
		md := c.msg.Metadata
		if md.Get(middleware.AttemptKey) != "2" || md.Get(retrymeta.RedeliveriesKey) != "1" ||
			md.Get(retrymeta.RemainingDelayKey) != "" || md.Get(retrymeta.DeliveryRetryPathKey) != "" || md.Get(retrymeta.DeliveryRedeliveredKey) != "" {
			t.Errorf("redelivered %v: copy metadata %v", redelivered, md)
		}
	}
	if ran != 0 {
		t.Fatalf("handler ran %d times for early deliveries", ran)
	}
	// Refused: not run, handed to the fallback as a ScheduleError.
	d.err = errors.New("alarm")
	msg := attemptMsg(1, "p")
	msg.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true")
	msg.Metadata.Set(retrymeta.RemainingDelayKey, "10")
	_, err = g.Middleware(h)(msg)
	var se *chainerr.ScheduleError
	if !errors.As(err, &se) || se.HandlerRan() || ran != 0 {
		t.Fatalf("refused copy: %v, ran %d", err, ran)
	}
}
