package cascadecore

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
)

func TestMessageDelay(t *testing.T) {
	now := time.Date(2025, 3, 1, 12, 0, 0, 400_000_000, time.UTC) // 12:00:00.4
	md := func(until, dfor string) *message.Message {
		m := message.NewMessage("x", nil)
		if until != "" {
			m.Metadata.Set(delay.DelayedUntilKey, until)
		}
		if dfor != "" {
			m.Metadata.Set(delay.DelayedForKey, dfor)
		}
		return m
	}
	for _, c := range []struct {
		name        string
		msg         *message.Message
		want        time.Duration
		ok, wantErr bool
	}{
		{"none", md("", ""), 0, false, false},
		// Marked just now with For(1.5s): due 12:00:01.9, written "12:00:01".
		{"fresh for", md("2025-03-01T12:00:01Z", "1.5s"), 1500 * time.Millisecond, true, false},
		// Marked 10 s ago with For(30s): due in [20.6 s, 21.6 s); at most For.
		{"old for", md("2025-03-01T12:00:21Z", "30s"), 21600 * time.Millisecond, true, false},
		{"until only", md("2025-03-01T12:00:05Z", ""), 4600 * time.Millisecond, true, false},
		{"until with fraction", md("2025-03-01T12:00:05.5Z", "9s"), 5100 * time.Millisecond, true, false},
		{"for only", md("", "250ms"), 250 * time.Millisecond, true, false},
		{"past", md("2025-03-01T11:00:00Z", "1s"), 0, true, false},
		{"negative for", md("", "-1s"), 0, true, false},
		{"bad until", md("tomorrow", "1s"), 0, false, true},
		{"bad for", md("2025-03-01T12:00:05Z", "soon"), 0, false, true},
	} {
		got, ok, err := messageDelay(c.msg, now)
		if got != c.want || ok != c.ok || (err != nil) != c.wantErr {
			t.Errorf("%s: messageDelay = %v, %v, %v; want %v, %v, error %v", c.name, got, ok, err, c.want, c.ok, c.wantErr)
		}
	}
	// What delay.For writes, read back at once, gives the duration back
	// (within the time between the two calls).
	m := message.NewMessage("x", nil)
	delay.Message(m, delay.For(2300*time.Millisecond))
	got, ok, err := messageDelay(m, time.Now())
	if !ok || err != nil || got > 2300*time.Millisecond || got < 2200*time.Millisecond {
		t.Errorf("delay.For(2.3s) read back as %v, %v, %v", got, ok, err)
	}
}

// TestHeaderLimit: a copy whose headers could not survive the x-death
// entries the levels add is refused before anything is published.
func TestHeaderLimit(t *testing.T) {
	d, err := NewDelayer(Config{Publisher: &confirm.Publisher{}, QueueName: func(context.Context) string { return "orders" }})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("big", nil)
	msg.Metadata.Set("big", strings.Repeat("x", amqpwire.MaxCopyHeaderBytes-4096))
	if err := d.Schedule(context.Background(), msg, time.Second); !errors.Is(err, middleware.ErrCannotDelay) {
		t.Fatalf("Schedule with %d header bytes: %v, want ErrCannotDelay", len(msg.Metadata["big"]), err)
	}
	if limit := d.c.headerLimit("orders"); limit < 100_000 || limit > amqpwire.MaxCopyHeaderBytes {
		t.Errorf("header limit %d", limit)
	}
}
