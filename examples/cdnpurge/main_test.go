package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

func TestCDNPurgeBurst(t *testing.T) {
	cfg := defaultConfig()
	cfg.URI = testkit.URI(t)

	// Own exchange and queue, so that a concurrent `go run ./examples/cdnpurge`
	// neither shares the queue nor receives our purge requests.
	id := strings.ToLower(watermill.NewShortUUID())
	cfg.Exchange = "cdn-test-" + id
	cfg.Queue = "cdn-test-" + id + ".purger"
	cfg.Requests = 60
	cfg.Timeout = 12 * time.Second
	out := &testkit.SyncBuffer{}
	cfg.Out = out
	t.Cleanup(func() {
		conn, err := amqp.Dial(cfg.URI)
		if err != nil {
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		defer ch.Close()
		queues := []string{cfg.Queue, cfg.Queue + ".poison"}
		for _, tier := range tiers {
			queues = append(queues, cfg.Queue+".wait."+retrymeta.FormatDelay(tier))
		}
		for _, q := range queues {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = ch.ExchangeDelete(cfg.Exchange, false, false)
	})

	ctx, cancel := context.WithTimeout(context.Background(), 14*time.Second)
	defer cancel()
	s, err := run(ctx, cfg)
	if s != nil {
		s.print(out)
	}
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.check(); err != nil {
		t.Error(err)
	}
	if s.Valid != 58 || s.Malformed != 2 {
		t.Errorf("published %d valid and %d malformed URLs, want 58 and 2", s.Valid, s.Malformed)
	}
	if s.PurgedOnce != s.Valid || s.Duplicates != 0 {
		t.Errorf("purged exactly once: %d of %d valid, %d duplicates", s.PurgedOnce, s.Valid, s.Duplicates)
	}
	if s.PoisonedMalformed != s.Malformed || len(s.ValidPoisoned) != 0 {
		t.Errorf("poisoned %d of %d malformed as permanent; valid ones poisoned: %v", s.PoisonedMalformed, s.Malformed, s.ValidPoisoned)
	}
	if s.N429 == 0 || s.N507 == 0 {
		t.Errorf("the burst met %d 429s and %d 507s, want at least one of each", s.N429, s.N507)
	}
	if s.Early != 0 {
		t.Errorf("%d retries came back before the CDN's Retry-After", s.Early)
	}
	if s.Lost != 0 {
		t.Errorf("lost %d", s.Lost)
	}
}

// TestStatusMapping checks how each CDN answer is classified, without a broker.
func TestStatusMapping(t *testing.T) {
	cases := []struct {
		status     int
		retryAfter string
		action     middleware.Action
		class      string
		delay      time.Duration
	}{
		{http.StatusCreated, "", -1, "", 0},
		{http.StatusTooManyRequests, "1", middleware.ActionRetry, middleware.ClassRetryAfter, time.Second},
		{http.StatusTooManyRequests, "2", middleware.ActionRetry, middleware.ClassRetryAfter, 2 * time.Second}, // the Delayer rounds it up to a tier
		{http.StatusTooManyRequests, "", middleware.ActionRetry, middleware.ClassTransient, 0},
		{http.StatusInsufficientStorage, "", middleware.ActionRetry, middleware.ClassTransient, 0},
		{http.StatusServiceUnavailable, "", middleware.ActionRetry, middleware.ClassTransient, 0},
		{http.StatusBadRequest, "", middleware.ActionPoison, middleware.ClassPermanent, 0},
	}
	for _, c := range cases {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if c.retryAfter != "" {
				w.Header().Set("Retry-After", c.retryAfter)
			}
			w.WriteHeader(c.status)
		}))
		p := &purger{endpoint: srv.URL, client: srv.Client(), tiers: tiers}
		err := p.handle(message.NewMessage(watermill.NewUUID(), []byte(`{"url":"https://cdn.example.com/a.js"}`)))
		srv.Close()
		if c.action == -1 {
			if err != nil {
				t.Errorf("%d: got %v, want nil", c.status, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("%d: got nil, want an error", c.status)
			continue
		}
		cl := middleware.DefaultClassifier.Classify(err)
		if cl.Action != c.action || cl.Class != c.class || cl.Delay != c.delay {
			t.Errorf("%d Retry-After %q: classified %v/%s/%v, want %v/%s/%v", c.status, c.retryAfter,
				cl.Action, cl.Class, cl.Delay, c.action, c.class, c.delay)
		}
	}
}
