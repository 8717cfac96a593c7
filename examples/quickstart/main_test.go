package main

import (
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// The quickstart story on gochannel: every order accounted for, billing once.
func TestQuickstartGoChannel(t *testing.T) {
	s := newStory()
	if err := runGoChannel(s, 30, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	checkStory(t, s, 30)
}

// The same story on RabbitMQ.
func TestQuickstartAMQP(t *testing.T) {
	uri := testkit.URI(t)
	s := newStory()
	if err := runAMQP(s, uri, 30, 60*time.Second); err != nil {
		t.Fatal(err)
	}
	checkStory(t, s, 30)
}

func checkStory(t *testing.T, s *story, n int) {
	t.Helper()
	if !s.summary() {
		t.Fatal("the accounting does not add up")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	// Every 7th order is malformed (4 of 30) and poisoned after one attempt;
	// orders 3, 6, 9, ... (not multiples of 7) fail 1-2 times, then succeed.
	if len(s.published) != n || len(s.poisoned) != n/7 {
		t.Fatalf("published %d, poisoned %d; want %d, %d", len(s.published), len(s.poisoned), n, n/7)
	}
	wantRetries := 0
	for i := 1; i <= n; i++ {
		if i%3 == 0 && i%7 != 0 {
			wantRetries += 1 + i%2
		}
	}
	if s.retried != wantRetries {
		t.Errorf("retries scheduled %d, want %d", s.retried, wantRetries)
	}
	for id, c := range s.billed {
		if c != 1 {
			t.Errorf("billing saw %s %d times", id, c)
		}
	}
}
