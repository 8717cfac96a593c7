package middleware_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

func TestAcquiredCountSource(t *testing.T) {
	src := amqpwire.AcquiredCountSource()
	for _, tc := range []struct {
		name        string
		redelivered bool
		count       string // "" = absent
		want        int64
		wantErr     bool
	}{
		{"first delivery, no header", false, "", 0, false},
		{"first delivery, forged header ignored", false, "9", 0, false},
		{"first delivery, malformed forged header ignored", false, "abc", 0, false},
		{"redelivered, no header", true, "", 0, false},
		{"redelivered once", true, "1", 1, false},
		{"redelivered thrice", true, "3", 3, false},
		{"capped", true, "99999999999999999999", middleware.MaxAttemptsCap, false},
		{"negative", true, "-1", 0, true},
		{"malformed", true, "x", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := message.NewMessage("u", nil)
			if tc.redelivered {
				msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
			}
			if tc.count != "" {
				msg.Metadata.Set(retrymeta.XAcquiredCountKey, tc.count)
			}
			n, err := src.Previous(msg)
			if (err != nil) != tc.wantErr || n != tc.want {
				t.Errorf("Previous = %d, %v; want %d, error %v", n, err, tc.want, tc.wantErr)
			}
		})
	}
}

// Header (wait-queue copy) and x-acquired-count (native returns of that
// copy) add up; a forged count on a first delivery does not.
func TestAcquiredCountSourceWithHeader(t *testing.T) {
	c, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: []middleware.AttemptSource{
		middleware.HeaderSource(nil), amqpwire.XDeathSource(nil), amqpwire.AcquiredCountSource(),
	}})
	if err != nil {
		t.Fatal(err)
	}
	msg := ownCopy(message.NewMessage("u", nil))
	msg.Metadata.Set(middleware.AttemptKey, "3")
	msg.Metadata.Set(retrymeta.XAcquiredCountKey, "2")
	if n, _ := c.Count(msg); n != 3 {
		t.Errorf("first delivery of copy 3 with forged count 2: attempt %d, want 3", n)
	}
	msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
	if n, _ := c.Count(msg); n != 5 {
		t.Errorf("copy 3 returned twice: attempt %d, want 5", n)
	}
}

// The native retry: ErrNativeRetry is an ErrDeadLetter, so the republisher
// returns a *DeadLetterRetryError marked Native; StripDeliveryMetadata drops
// x-acquired-count.
func TestNativeRetryErrorAndStrip(t *testing.T) {
	r, err := middleware.NewRepublisher(middleware.RepublisherConfig{
		Delayer:     testkit.DelayerFunc(func(_ context.Context, _ *message.Message, _ time.Duration) error { return chainerr.ErrNativeRetry }),
		MaxAttempts: 3,
	})
	if err != nil {
		t.Fatal(err)
	}
	h := r.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, &middleware.ClassifiedError{Err: errors.New("boom"), Classification: middleware.Classification{Action: middleware.ActionRetry, Class: middleware.ClassTransient}}
	})
	_, err = h(message.NewMessage("u", nil))
	var dl *chainerr.DeadLetterRetryError
	if !errors.As(err, &dl) || !dl.Native || !strings.Contains(err.Error(), "native delayed retry") {
		t.Fatalf("err = %v, want a native *DeadLetterRetryError", err)
	}
	md := message.Metadata{retrymeta.XAcquiredCountKey: "2", "keep": "x"}
	retrymeta.StripDeliveryMetadata(md)
	if _, ok := md[retrymeta.XAcquiredCountKey]; ok || md["keep"] != "x" {
		t.Errorf("after strip: %v", md)
	}
}

// With RedeliveriesCounted the guard lets a redelivered message run, with
// no copy (a copy would undo the broker's delay).
func TestRedeliveryGuardRedeliveriesCounted(t *testing.T) {
	copies := 0
	g, err := middleware.NewRedeliveryGuard(middleware.RedeliveryGuardConfig{
		Delayer:             testkit.DelayerFunc(func(context.Context, *message.Message, time.Duration) error { copies++; return nil }),
		RedeliveriesCounted: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := g.Middleware(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
	msg := message.NewMessage("u", nil)
	msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
	msg.Metadata.Set(retrymeta.RedeliveriesKey, "100")
	if _, err := h(msg); err != nil || ran != 1 || copies != 0 {
		t.Errorf("err %v, handler ran %d times, %d copies; want nil, 1, 0", err, ran, copies)
	}
}
