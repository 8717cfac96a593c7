package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"
)

func TestReplayStory(t *testing.T) {
	cfg := defaultConfig()
	cfg.URI = testkit.URI(t)

	// Own queues and exchange, so that a concurrent `go run ./examples/replay`
	// (or another test run) neither shares the queue nor receives our orders.
	prefix := "replay-test-" + strings.ToLower(watermill.NewShortUUID())
	cfg.Prefix = prefix
	cfg.Exchange = prefix + ".orders"
	cfg.Timeout = 45 * time.Second
	out := &testkit.SyncBuffer{}
	cfg.Out = out
	t.Cleanup(func() {
		conn, err := amqp.Dial(cfg.URI)
		if err != nil {
			return
		}
		defer conn.Close()
		if ch, err := conn.Channel(); err == nil {
			_ = ch.ExchangeDelete(cfg.Exchange, false, false)
			_ = ch.Close()
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sum, err := run(ctx, cfg)
	sum.print(out)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatalf("run: %v", err)
	}

	queue := prefix + ".mailer"
	checks := []struct {
		name      string
		got, want int
	}{
		{"published", sum.Published, 30},
		{"poisoned", sum.Poisoned, 10},
		{"replayed", sum.Replayed, 10},
		{"mailed", sum.Mailed, 30},
		{"mailed exactly once", sum.MailedOnce, 30},
		{"duplicates", sum.Duplicates, 0},
		{"lost", sum.Lost, 0},
		{"left in poison queue", sum.PoisonLeft, 0},
		{"foreign orders", sum.Ignored, 0},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
	if !sum.OK() {
		t.Errorf("summary not OK: %+v", sum)
	}
	for _, want := range []string{
		fmt.Sprintf(`rabbitretry_poisoned_total{class="permanent",queue="%s"} 10`, queue),
		fmt.Sprintf(`rabbitretry_attempts_total{outcome="success",queue="%s"} 30`, queue),
		fmt.Sprintf(`rabbitretry_attempts_total{outcome="error",queue="%s"} 10`, queue),
	} {
		if !containsLine(sum.Metrics, want) {
			t.Errorf("metrics scrape lacks %q; got:\n%s", want, sum.Metrics)
		}
	}
	for _, want := range []string{
		"go run ./cmd/poisonctl --queue " + queue + ".poison list",
		"go run ./cmd/poisonctl --queue " + queue + ".poison replay --reason example.invalid",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}

	// The queues are deleted at the end (no -keep).
	if _, err := queueDepth(cfg.URI, queue); err == nil {
		t.Errorf("queue %s still exists after the run", queue)
	}
}
