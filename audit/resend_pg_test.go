package audit_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// newResendPGStore is a pgstore.Store in a schema of its own, dropped at
// the end.
func newResendPGStore(t *testing.T) *pgstore.Store {
	t.Helper()
	dsn := testkit.HavePG(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "rrresend_" + hex.EncodeToString(b[:])
	st, err := pgstore.New(context.Background(), pgstore.Config{DSN: dsn, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = st.Pool().Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`)
		st.Close()
	})
	return st
}

// The real store: headers round-trip through jsonb, the header filter is
// jsonb containment, and Resend pages with SearchPage: a Limit smaller
// than the matches leaves a Next cursor, and walking the cursors resends
// every matching message exactly once.
func TestResendFromPostgresPagesByHeader(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendPGStore(t)
	acme := map[string]bool{}
	var arrivals []audit.Arrival
	var attempts []audit.Attempt
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Millisecond)
	for i := range 30 {
		id := fmt.Sprintf("pg-%02d", i)
		tenant := "globex"
		if i%5 < 2 {
			tenant = "acme"
			acme[id] = true
		}
		a := resendArrival(id, tp.business, tp.key, map[string]any{"tenant": tenant, "_watermill_message_uuid": id, "n": i}, "body-"+id)
		a.ArrivedAt = base.Add(time.Duration(i) * time.Second)
		arrivals = append(arrivals, a)
		attempts = append(attempts, audit.Attempt{ID: "att-" + id, MessageID: id, Queue: tp.q1, Attempt: 1, StartedAt: a.ArrivedAt, Outcome: audit.OutcomePoisoned, ErrorClass: "permanent"})
	}
	if err := st.Write(context.Background(), arrivals, attempts); err != nil {
		t.Fatal(err)
	}
	r := newTestResender(t, st, tp)
	f := audit.Filter{Headers: map[string]any{"tenant": "acme"}}
	sent, rounds := 0, 0
	for {
		rep, err := r.Resend(context.Background(), f, audit.ResendOptions{Mode: audit.ResendToQueue, Limit: 5, AllowAll: true}) // 12 acme: broad
		if err != nil {
			t.Fatal(err)
		}
		rounds++
		if rep.Matched > 5 || rep.Failed+rep.Skipped != 0 {
			t.Fatalf("round %d: %+v", rounds, rep)
		}
		sent += rep.Sent
		if rep.Next == "" {
			break
		}
		f.After = rep.Next
	}
	got := tp.drain(t, tp.q1, len(acme))
	tp.drain(t, tp.q2, 0)
	seen := map[string]bool{}
	for _, d := range got {
		id, _ := d.Headers["_watermill_message_uuid"].(string)
		if !acme[id] || seen[id] {
			t.Fatalf("received %q: not acme, or twice", id)
		}
		seen[id] = true
		if d.Headers["n"] != int64(mustAtoi(id[3:])) {
			t.Fatalf("%s: header n = %#v, want int64 %s", id, d.Headers["n"], id[3:])
		}
	}
	if sent != len(acme) || rounds != 3 {
		t.Fatalf("sent %d in %d rounds, want %d in 3", sent, rounds, len(acme))
	}
	t.Logf("accounting: stored 30, acme %d, sent %d in %d pages of 5, received %d, others untouched %d", len(acme), sent, rounds, len(got), 30-len(acme))
}

func mustAtoi(s string) int {
	var n int
	_, _ = fmt.Sscanf(s, "%d", &n)
	return n
}
