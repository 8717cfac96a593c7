package middleware_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

func redelivered(attempt int, redeliveries string) *message.Message {
	msg := attemptMsg(attempt, "p")
	msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
	msg.Metadata.Set(retrymeta.DeliveryExchangeKey, "biz")
	if redeliveries != "" {
		msg.Metadata.Set(retrymeta.RedeliveriesKey, redeliveries)
	}
	return msg
}

func TestRedeliveryGuardCountsOnACopy(t *testing.T) {
	d := &recordingDelayer{}
	g, err := middleware.NewRedeliveryGuard(middleware.RedeliveryGuardConfig{Delayer: d, MaxRedeliveries: 3})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil }

	// Not redelivered: runs, no copy.
	if _, err := g.Middleware(h)(attemptMsg(2, "p")); err != nil || ran != 1 || len(d.Calls()) != 0 {
		t.Fatalf("plain delivery: err %v, ran %d, copies %d", err, ran, len(d.Calls()))
	}
	// Redelivered: not run; a copy with the count +1, same attempt, no
	// delivery-only keys, delay 0.
	for i, in := range []string{"", "1", "garbage", "-4"} {
		if _, err := g.Middleware(h)(redelivered(2, in)); err != nil {
			t.Fatalf("redelivery %q: %v", in, err)
		}
		c := d.Calls()[i]
		want := map[string]string{"": "1", "1": "2", "garbage": "1", "-4": "1"}[in]
		if got := c.msg.Metadata.Get(retrymeta.RedeliveriesKey); got != want || c.delay != 0 ||
			c.msg.Metadata.Get(middleware.AttemptKey) != "2" ||
			c.msg.Metadata.Get(retrymeta.DeliveryRedeliveredKey) != "" || c.msg.Metadata.Get(retrymeta.DeliveryExchangeKey) != "" {
			t.Fatalf("redelivery %q: copy redeliveries %q (want %s), delay %v, metadata %v", in, got, want, c.delay, c.msg.Metadata)
		}
	}
	if ran != 1 {
		t.Fatalf("handler ran %d times, want 1 (redeliveries are not run)", ran)
	}
	// At the limit (the redelivery that brings the count to
	// MaxRedeliveries): poisoned, not copied, not run.
	_, err = g.Middleware(h)(redelivered(2, "2"))
	var ce *middleware.ClassifiedError
	if !errors.As(err, &ce) || ce.Action != middleware.ActionPoison || ce.Class != middleware.ClassRedeliveryLimit {
		t.Fatalf("past the limit: %v", err)
	}
	if ran != 1 || len(d.Calls()) != 4 {
		t.Fatalf("past the limit: ran %d, copies %d", ran, len(d.Calls()))
	}
}

func TestRedeliveryGuardCopyRefused(t *testing.T) {
	refused := errors.New("broker alarm")
	d := &recordingDelayer{err: refused}
	g, err := middleware.NewRedeliveryGuard(middleware.RedeliveryGuardConfig{Delayer: d})
	if err != nil {
		t.Fatal(err)
	}
	ran := false
	_, err = g.Middleware(func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil })(redelivered(1, ""))
	var se *chainerr.ScheduleError
	if !errors.As(err, &se) || !errors.Is(err, refused) || se.HandlerRan() || ran {
		t.Fatalf("refused copy: err %v, handler ran %v", err, ran)
	}
	// ErrCannotDelay: poisoned as undelayable.
	d.err = middleware.ErrCannotDelay
	_, err = g.Middleware(failWith(errors.New("x")))(redelivered(1, ""))
	var ce *middleware.ClassifiedError
	if !errors.As(err, &ce) || ce.Class != middleware.ClassUndelayable {
		t.Fatalf("undelayable: %v", err)
	}
}

func TestRedeliveryGuardConfigValidate(t *testing.T) {
	for _, cfg := range []middleware.RedeliveryGuardConfig{{}, {Delayer: &recordingDelayer{}, MaxRedeliveries: -1}} {
		if _, err := middleware.NewRedeliveryGuard(cfg); err == nil {
			t.Errorf("%+v: no error", cfg)
		}
	}
}

// quarantiningDelayer is a recordingDelayer that also implements
// retrymeta.Quarantiner.
type quarantiningDelayer struct {
	recordingDelayer
	quarantined []*message.Message
	qerr        error
}

func (d *quarantiningDelayer) Quarantine(_ context.Context, msg *message.Message) error {
	d.quarantined = append(d.quarantined, msg)
	return d.qerr
}

// With a quarantine, a redelivery in the message's own queue is not
// attributable: it moves the message to the quarantine (count unchanged,
// never poisoned there); only a redelivery in the quarantine counts and can
// poison it, at MaxRedeliveries-1 (the uncounted crash outside may have
// been its own).
func TestRedeliveryGuardQuarantine(t *testing.T) {
	d := &quarantiningDelayer{}
	g, err := middleware.NewRedeliveryGuard(middleware.RedeliveryGuardConfig{Delayer: d, MaxRedeliveries: 3})
	if err != nil {
		t.Fatal(err)
	}
	h := func(*message.Message) ([]*message.Message, error) { t.Fatal("handler ran"); return nil, nil }
	inQuarantine := func(r string) *message.Message {
		m := redelivered(1, r)
		m.Metadata.Set(retrymeta.DeliveryQuarantineKey, "true")
		return m
	}
	// In Q, even far past the limit: moved, not poisoned.
	for _, r := range []string{"", "7"} {
		if _, err := g.Middleware(h)(redelivered(1, r)); err != nil {
			t.Fatalf("redelivered in Q with %q: %v", r, err)
		}
	}
	// In the quarantine, below the limit: counted, back into the quarantine.
	if _, err := g.Middleware(h)(inQuarantine("")); err != nil {
		t.Fatal(err)
	}
	if len(d.quarantined) != 3 || len(d.Calls()) != 0 {
		t.Fatalf("%d quarantined, %d scheduled", len(d.quarantined), len(d.Calls()))
	}
	for i, want := range []string{"", "7", "1"} {
		m := d.quarantined[i]
		if got := m.Metadata.Get(retrymeta.RedeliveriesKey); got != want || m.Metadata.Get(retrymeta.DeliveryQuarantineKey) != "" {
			t.Errorf("copy %d: redeliveries %q (want %s), metadata %v", i, got, want, m.Metadata)
		}
	}
	// In the quarantine, at the limit (MaxRedeliveries-1): poisoned.
	_, err = g.Middleware(h)(inQuarantine("1"))
	var ce *middleware.ClassifiedError
	if !errors.As(err, &ce) || ce.Class != middleware.ClassRedeliveryLimit {
		t.Fatalf("at the limit in the quarantine: %v", err)
	}
	// MaxRedeliveries 1: the first attributable redelivery poisons it (two
	// crashes in all).
	g1, err := middleware.NewRedeliveryGuard(middleware.RedeliveryGuardConfig{Delayer: d, MaxRedeliveries: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err = g1.Middleware(h)(inQuarantine("")); !errors.As(err, &ce) || ce.Class != middleware.ClassRedeliveryLimit {
		t.Fatalf("MaxRedeliveries 1, first redelivery in the quarantine: %v", err)
	}
	// No quarantine consumer in this process: counted in Q as before.
	d.qerr = retrymeta.ErrNoQuarantine
	if _, err := g.Middleware(h)(redelivered(1, "1")); err != nil || len(d.Calls()) != 1 {
		t.Fatalf("no quarantine: err %v, %d scheduled", err, len(d.Calls()))
	}
	if _, err = g.Middleware(h)(redelivered(1, "2")); !errors.As(err, &ce) || ce.Class != middleware.ClassRedeliveryLimit {
		t.Fatalf("no quarantine, at the limit: %v", err)
	}
}

// An explicit count of 0 is no redelivery (not clamped to 1 like an
// attempt number).
func TestRedeliveriesZero(t *testing.T) {
	for v, want := range map[string]int{"": 0, "0": 0, "-3": 0, "x": 0, "2": 2} {
		m := message.NewMessage("u", nil)
		if v != "" {
			m.Metadata.Set(retrymeta.RedeliveriesKey, v)
		}
		if got := retrymeta.Redeliveries(m); got != want {
			t.Errorf("Redeliveries(%q) = %d, want %d", v, got, want)
		}
	}
}
