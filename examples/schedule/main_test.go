package main

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/internal/cascadecore"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// The story in seconds ("minute" 200 ms, "day" 1.5 s) on the real broker:
// each message arrives once, at its own queue, never before its due time
// and at most 1.5 s after it (the grain, the hops and the delivery; the
// same tolerance as the cascade's broker tests); the job ran 3 times.
func TestScheduleStory(t *testing.T) {
	uri := testkit.URI(t)
	prefix := testkit.UniqueName(t, "it.schedule")
	ccfg := cascade.Config{Prefix: prefix + ".cascade"}
	var out testkit.SyncBuffer
	t.Cleanup(func() {
		conn, err := amqp.Dial(uri)
		if err != nil {
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		_ = cascadecore.Config{Prefix: ccfg.Prefix}.Delete(ch) // the cascade Run used
		for _, q := range []string{".reminders", ".invoices", ".jobs"} {
			_, _ = ch.QueueDelete(prefix+q, false, false, false)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := Run(ctx, Config{URI: uri, Minute: 200 * time.Millisecond, Day: 1500 * time.Millisecond, Prefix: prefix, Cascade: ccfg, Out: &out})
	t.Logf("output:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Planned) != 4 || len(res.Arrivals) != 4 || res.JobAttempts != 3 {
		t.Fatalf("planned %d, arrivals %d, job attempts %d; want 4, 4, 3", len(res.Planned), len(res.Arrivals), res.JobAttempts)
	}
	seen := map[string]bool{}
	for _, a := range res.Arrivals {
		if seen[a.ID] {
			t.Errorf("%s arrived twice", a.ID)
		}
		seen[a.ID] = true
	}
	for _, p := range res.Planned {
		var got *Arrival
		for i := range res.Arrivals {
			if res.Arrivals[i].ID == p.ID {
				got = &res.Arrivals[i]
			}
		}
		if got == nil {
			t.Errorf("%s never arrived", p.ID)
			continue
		}
		late := got.At.Sub(p.Due)
		if got.Queue != p.Queue || late < -5*time.Millisecond || late > 1500*time.Millisecond {
			t.Errorf("%s arrived at %s %v after its due time; want %s, within [-5ms, 1.5s]", p.ID, got.Queue, late, p.Queue)
		}
	}
}
