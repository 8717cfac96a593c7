package amqpretry_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/metrics"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// TestE2E_WaitingCollector: a retry waiting in the 1 min tier shows as
// waiting_messages{queue, stage="1m"} 1 at scrape time, the poison queue as 0.
func TestE2E_WaitingCollector(t *testing.T) {
	e := newEnv(t, amqpretry.QueueTypeClassic, func(c *amqpretry.Config) {
		c.Mode = amqpretry.Tiers(time.Minute)
		c.Backoff = fixedBackoff(time.Minute)
	})
	runs := newRecorder()
	q := e.handle("billing", func(msg *message.Message) error {
		runs.record(msg, middleware.Attempt(msg))
		return errors.New("gateway down")
	})
	e.start()
	e.publish(message.NewMessage("w1", nil))
	waitFor(t, 20*time.Second, "first run", func() bool { return runs.count("w1") == 1 })
	waitFor(t, 20*time.Second, "retry waiting", func() bool { return e.depth(e.retry.Topology().WaitQueues(q)[0]) == 1 })

	c, err := metrics.NewWaitingCollector(metrics.WaitingConfig{Sample: func(ctx context.Context) ([]metrics.WaitingCount, error) {
		ds, err := e.retry.Waiting(ctx, q, q+".missing")
		out := make([]metrics.WaitingCount, len(ds))
		for i, d := range ds {
			out[i] = metrics.WaitingCount(d)
		}
		return out, err
	}})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	tier := retrymeta.FormatDelay(time.Minute)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "rabbitretry_waiting_messages" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["queue"] != q {
				t.Errorf("series for queue %q (a missing queue must be skipped)", labels["queue"])
			}
			got[labels["stage"]] = m.GetGauge().GetValue()
		}
	}
	if got[tier] != 1 || got["poison"] != 0 || len(got) != 2 {
		t.Errorf("waiting_messages = %v, want %s:1 poison:0", got, tier)
	}
}
