package pgstore

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
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
	res, err := s.Prune(ctx, cutoff, 700)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Prune = %+v", res)
	if res.Arrivals != nOld+1 || res.Attempts != nOld+1 || res.Messages != nOld {
		t.Fatalf("deleted arrivals=%d attempts=%d messages=%d, want %d/%d/%d", res.Arrivals, res.Attempts, res.Messages, nOld+1, nOld+1, nOld)
	}
	// 3001 rows at 700 a statement: 5 for arrivals, 5 for attempts, 5 for
	// the 3001 messages rows timed before the cutoff (3000 + straddle).
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
	// Search still finds the straddling message, now timed by its
	// remaining attempt (cutoff+1h: the newest), and cursorOf agrees with
	// SearchPage's cursor for it.
	page, next, err := s.SearchPage(ctx, audit.Filter{Limit: 1})
	if err != nil || len(page) != 1 || page[0].MessageID != "straddle" {
		t.Fatalf("newest message after Prune = %v, %v; want straddle", ids(page), err)
	}
	if c, err := cursorOf(page[0]); err != nil || c != next {
		t.Fatalf("cursorOf(straddle) = %q, %v; SearchPage's cursor %q", c, err, next)
	}
	if got, err := s.Search(ctx, audit.Filter{To: cutoff}); err != nil || len(got) != 0 {
		t.Fatalf("messages timed before the cutoff after Prune: %v, %v", ids(got), err)
	}
	// Nothing left to prune: one statement per table, nothing deleted.
	n, err := s.Prune(ctx, cutoff, 0)
	if err != nil || n.Arrivals+n.Attempts != 0 {
		t.Fatalf("second Prune = %+v, %v", n, err)
	}
	t.Logf("ACCOUNT %s: written=%d records, pruned=%d (old), kept=%d (new), wrongly pruned=0, left behind=0",
		t.Name(), len(arr)+len(att), res.Arrivals+res.Attempts, a+b)
}

// A Write in flight while Prune runs (the message's old records all
// pruned, the Write adds another one older than the cutoff, e.g. the audit
// consumer catching up after an outage): Prune does not wait for it (it
// skips the messages row the Write holds) and the message stays findable.
func TestPruneRacesWrite(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	cutoff := t0
	old := arrival("m-old", cutoff.Add(-48*time.Hour))
	if err := s.Write(ctx, []audit.Arrival{old}, nil); err != nil {
		t.Fatal(err)
	}
	late := attempt("m-old", 1, cutoff.Add(-47*time.Hour), audit.OutcomePoisoned)
	b, err := buildWriteBatch(s.q, nil, []audit.Attempt{late})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := tx.SendBatch(ctx, b).Close(); err != nil { // attempt inserted, messages row locked
		t.Fatal(err)
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res, err := s.Prune(pctx, cutoff, 0) // must not wait for tx
	if err != nil {
		t.Fatalf("Prune alongside an open Write: %v", err)
	}
	t.Logf("Prune = %+v", res)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	m, ok, err := s.Get(ctx, "m-old")
	if err != nil || !ok || len(m.Attempts) != 1 || m.Arrival != nil {
		t.Fatalf("Get(m-old) = %+v %v %v, want the late attempt", m, ok, err)
	}
	got, err := s.Search(ctx, audit.Filter{LastOutcome: audit.OutcomePoisoned})
	if err != nil || len(got) != 1 || got[0].MessageID != "m-old" {
		t.Fatalf("Search after the race = %v, %v; want m-old (its messages row)", ids(got), err)
	}
	if res.Arrivals != 1 || res.Messages != 0 {
		t.Fatalf("Prune = %+v, want 1 arrival and no message deleted", res)
	}
	// The next Prune takes the late attempt and then the message.
	if res, err = s.Prune(ctx, cutoff, 0); err != nil || res.Attempts != 1 || res.Messages != 1 {
		t.Fatalf("second Prune = %+v, %v; want the attempt and the message", res, err)
	}
}

// Writers and Prune at once, records on both sides of the cutoff: no
// record ever lacks its messages row (it would be invisible to Search),
// every record at or after the cutoff survives, and once the writers stop
// a last Prune leaves nothing before the cutoff.
func TestPruneConcurrentWriters(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	cutoff := t0
	const writers, batches, perBatch = 4, 15, 150
	var wg sync.WaitGroup
	var newRecords atomic.Int64
	errs := make(chan error, writers+1)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range batches {
				var arr []audit.Arrival
				var att []audit.Attempt
				for i := range perBatch / 3 {
					// Messages shared across writers (same ids, other batches).
					mid := fmt.Sprintf("w-%02d-%03d", (w+b)%writers, (b*perBatch/3+i)%200)
					// Times from cutoff-30m to cutoff+30m.
					at := cutoff.Add(time.Duration((w*7919+b*104729+i*31)%3600-1800) * time.Second)
					a := arrival(mid, at)
					a.ID = fmt.Sprintf("arr-%d-%d-%d", w, b, i)
					arr = append(arr, a)
					for k := 1; k <= 2; k++ {
						x := attempt(mid, k, at.Add(time.Duration(k*90)*time.Second), audit.OutcomeRetry)
						x.ID = fmt.Sprintf("att-%d-%d-%d-%d", w, b, i, k)
						att = append(att, x)
					}
				}
				n := int64(0)
				for _, a := range arr {
					if !a.ArrivedAt.Before(cutoff) {
						n++
					}
				}
				for _, a := range att {
					if !a.StartedAt.Before(cutoff) {
						n++
					}
				}
				if err := s.Write(ctx, arr, att); err != nil {
					errs <- err
					return
				}
				newRecords.Add(n)
			}
		}()
	}
	stop := make(chan struct{})
	pruned := make(chan PruneResult, 1)
	go func() {
		var total PruneResult
		defer func() { pruned <- total }()
		for {
			r, err := s.Prune(ctx, cutoff, 50)
			if err != nil {
				errs <- err
				return
			}
			total.Arrivals += r.Arrivals
			total.Attempts += r.Attempts
			total.Messages += r.Messages
			total.Statements += r.Statements
			select {
			case <-stop:
				return
			default:
			}
		}
	}()
	wg.Wait()
	close(stop)
	total := testkit.Recv(t, pruned, 60*time.Second)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	orphans := func() int64 {
		var n int64
		if err := s.pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM `+s.q.arrivals+` a WHERE NOT EXISTS (SELECT 1 FROM `+s.q.messages+` m WHERE m.message_id = a.message_key)) +
			(SELECT count(*) FROM `+s.q.attempts+` t WHERE NOT EXISTS (SELECT 1 FROM `+s.q.messages+` m WHERE m.message_id = t.message_id))`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := orphans(); n != 0 {
		t.Fatalf("%d records without their messages row after concurrent Write and Prune", n)
	}
	if _, err := s.Prune(ctx, cutoff, 0); err != nil {
		t.Fatal(err)
	}
	var old, kept int64
	if err := s.pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM `+s.q.arrivals+` WHERE arrived_at < $1) + (SELECT count(*) FROM `+s.q.attempts+` WHERE started_at < $1) +
		(SELECT count(*) FROM `+s.q.messages+` WHERE message_time < $1),
		(SELECT count(*) FROM `+s.q.arrivals+`) + (SELECT count(*) FROM `+s.q.attempts+`)`, cutoff).Scan(&old, &kept); err != nil {
		t.Fatal(err)
	}
	t.Logf("ACCOUNT %s: written=%d records (%d at/after the cutoff), concurrent prunes deleted %d arrivals + %d attempts in %d statements, kept=%d, orphans=0, old left=%d",
		t.Name(), writers*batches*perBatch, newRecords.Load(), total.Arrivals, total.Attempts, total.Statements, kept, old)
	if old != 0 || kept != newRecords.Load() || orphans() != 0 {
		t.Fatalf("after the last Prune: %d rows before the cutoff, %d records kept (want %d), %d orphans", old, kept, newRecords.Load(), orphans())
	}
}
