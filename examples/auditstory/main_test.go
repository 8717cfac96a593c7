package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// TestAuditStory runs the whole story on the real broker and PostgreSQL:
// the operator finds exactly the affected orders, resends them to the
// billing queue only, each is billed once more, the rest untouched.
func TestAuditStory(t *testing.T) {
	cfg := defaultConfig()
	cfg.URI = testkit.URI(t)
	cfg.DSN = testkit.HavePG(t)
	cfg.Prefix = "auditstory_" + strings.ToLower(watermill.NewShortUUID())
	cfg.Orders = 60
	cfg.Timeout = 60 * time.Second
	out := &testkit.SyncBuffer{}
	cfg.Out = out
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sum, err := run(ctx, cfg)
	sum.print(out)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	if !sum.OK() {
		t.Fatalf("accounting does not add up: %+v", sum)
	}
	if sum.WronglyBilled != 20 || sum.Poisoned != 20 || sum.Untouched != 20 {
		t.Errorf("wrongly billed %d, poisoned %d, untouched %d; want 20 each", sum.WronglyBilled, sum.Poisoned, sum.Untouched)
	}
	t.Logf("ACCOUNT test=TestAuditStory published=%d handled=%d poisoned=%d resent=%d rebilled=%d duplicates=%d lost=%d",
		sum.Published, sum.Published, sum.Poisoned, sum.Resent, sum.Rebilled, sum.Duplicates, sum.Lost)
}
