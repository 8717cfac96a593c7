package pgstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
)

// Prune deletes exactly the records older than the cutoff, in several
// batches, and leaves the newer ones whole.
func TestPrune(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	cutoff := t0
	old := cutoff.Add(-48 * time.Hour)
	const nOld, nNew = 3000, 400
	var arr []audit.Arrival
	var att []audit.Attempt
	for i := range nOld {
		mid := fmt.Sprintf("old-%04d", i)
		at := old.Add(time.Duration(i) * time.Second)
		arr = append(arr, arrival(mid, at))
		att = append(att, attempt(mid, 1, at.Add(time.Second), audit.OutcomeSuccess))
	}
	for i := range nNew {
		mid := fmt.Sprintf("new-%04d", i)
		at := cutoff.Add(time.Duration(i) * time.Millisecond) // first one exactly at the cutoff: kept
		arr = append(arr, arrival(mid, at))
		att = append(att, attempt(mid, 1, at.Add(time.Second), audit.OutcomeRetry),
			attempt(mid, 2, at.Add(time.Minute), audit.OutcomeSuccess))
	}
	// Straddling: arrived before the cutoff, last attempt after it.
	arr = append(arr, arrival("straddle", cutoff.Add(-time.Hour)))
	att = append(att, attempt("straddle", 1, cutoff.Add(-time.Hour), audit.OutcomeRetry),
		attempt("straddle", 2, cutoff.Add(time.Hour), audit.OutcomeSuccess))
	if err := s.Write(ctx, arr, att); err != nil {
		t.Fatal(err)
	}
	res, err := s.PruneDetail(ctx, cutoff, 700)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("PruneDetail = %+v", res)
	if res.Arrivals != nOld+1 || res.Attempts != nOld+1 || res.Messages != nOld {
		t.Fatalf("deleted arrivals=%d attempts=%d messages=%d, want %d/%d/%d", res.Arrivals, res.Attempts, res.Messages, nOld+1, nOld+1, nOld)
	}
	// 3001 rows at 700 a statement: 5 for arrivals, 5 for attempts, 5 for messages.
	if res.Statements != 15 {
		t.Fatalf("%d DELETE statements, want 15 (batches of 700)", res.Statements)
	}
	a, b, m := counts(t, s)
	if a != nNew || b != 2*nNew+1 || m != nNew+1 {
		t.Fatalf("left arrivals=%d attempts=%d messages=%d, want %d/%d/%d", a, b, m, nNew, 2*nNew+1, nNew+1)
	}
	for _, mid := range []string{"new-0000", "new-0399"} {
		msg, ok, err := s.Get(ctx, mid)
		if err != nil || !ok || msg.Arrival == nil || len(msg.Attempts) != 2 {
			t.Fatalf("%s after Prune: %+v %v %v", mid, msg, ok, err)
		}
	}
	if _, ok, _ := s.Get(ctx, "old-0000"); ok {
		t.Fatal("old-0000 still there")
	}
	msg, ok, _ := s.Get(ctx, "straddle")
	if !ok || msg.Arrival != nil || len(msg.Attempts) != 1 || msg.Attempts[0].Attempt != 2 {
		t.Fatalf("straddle after Prune: %+v", msg)
	}
	// Search still finds the straddling message (by its attempt).
	got, err := s.Search(ctx, audit.Filter{Queue: "orders-q", LastOutcome: audit.OutcomeSuccess, To: cutoff})
	if err != nil || len(got) != 1 || got[0].MessageID != "straddle" {
		t.Fatalf("Search after Prune = %v, %v", ids(got), err)
	}
	// Nothing left to prune: one statement per table, nothing deleted.
	n, err := s.Prune(ctx, cutoff, 0)
	if err != nil || n != 0 {
		t.Fatalf("second Prune = %d, %v", n, err)
	}
	t.Logf("ACCOUNT %s: written=%d records, pruned=%d (old), kept=%d (new), wrongly pruned=0, left behind=0",
		t.Name(), len(arr)+len(att), res.Arrivals+res.Attempts, a+b)
}
