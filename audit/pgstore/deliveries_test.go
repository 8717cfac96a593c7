package pgstore

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
)

// The unacked_arrivals rows (deliverylog.Log): written with their
// arrivals in one transaction, a row moved to a new session by a rewrite,
// each row claimed by exactly one of many concurrent claimers, marked
// acking (then not claimable) and deleted by the next mark only for its
// own session, and rows older than a day pruned.
func TestDeliveryLogRows(t *testing.T) {
	st := newTestStore(t)
	s := (*deliveryLog)(st)
	ctx := context.Background()
	now := time.Now()
	a1, a2, a3 := arrival("m1", now), arrival("m1", now), arrival("m2", now)
	a1.ID, a2.ID, a3.ID = "id-1", "id-2", "id-3"
	d := func(id, fp, sess string) deliverylog.Delivery {
		return deliverylog.Delivery{ArrivalID: id, Fingerprint: fp, Session: sess}
	}
	if err := s.WriteDeliveries(ctx, []audit.Arrival{a1, a2, a3}, nil,
		[]deliverylog.Delivery{d("id-1", "fp-same", "dead"), d("id-2", "fp-same", "dead"), d("id-3", "fp-other", "live")}); err != nil {
		t.Fatal(err)
	}
	if arr, _, _ := counts(t, st); arr != 3 {
		t.Fatalf("%d arrivals, want 3", arr)
	}
	rows, err := s.UnackedDeliveries(ctx, []string{"fp-same"})
	if err != nil || len(rows) != 2 {
		t.Fatalf("rows of fp-same: %v, %v", rows, err)
	}
	// 2 rows of one fingerprint, 8 concurrent claimers each trying both:
	// exactly 2 claims succeed, each row once.
	var won atomic.Int32
	claimed := map[string]string{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sess := fmt.Sprint("claimer-", g)
			for _, r := range rows {
				ok, err := s.ClaimDelivery(ctx, r.ArrivalID, "dead", sess)
				if err != nil {
					t.Error(err)
					return
				}
				if ok {
					won.Add(1)
					mu.Lock()
					if prev, dup := claimed[r.ArrivalID]; dup {
						t.Errorf("%s claimed by %s and %s", r.ArrivalID, prev, sess)
					}
					claimed[r.ArrivalID] = sess
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	if won.Load() != 2 {
		t.Fatalf("%d claims won, want 2", won.Load())
	}
	// A rewrite of a claimed arrival (the redelivery's batch) keeps one row,
	// now the writer's session; the arrival is not stored twice.
	if err := s.WriteDeliveries(ctx, nil, nil, []deliverylog.Delivery{d("id-1", "fp-same", "next")}); err != nil {
		t.Fatal(err)
	}
	rows, _ = s.UnackedDeliveries(ctx, []string{"fp-same"})
	if len(rows) != 2 || rows[0].Session == "dead" || rows[1].Session == "dead" {
		t.Fatalf("rows after the claims: %+v", rows)
	}
	// Acking: only the named session's rows are marked; an acking row is
	// never claimed, and the session's next mark deletes it (its ack was
	// sent) while marking the next rows.
	if err := s.DeliveriesAcking(ctx, "someone-else", []string{"id-1", "id-2", "id-3"}); err != nil {
		t.Fatal(err)
	}
	if rows, _ = s.UnackedDeliveries(ctx, []string{"fp-same", "fp-other"}); len(rows) != 3 || rows[0].Acking || rows[1].Acking || rows[2].Acking {
		t.Fatalf("another session's mark changed rows: %+v", rows)
	}
	if err := s.DeliveriesAcking(ctx, "live", []string{"id-3"}); err != nil {
		t.Fatal(err)
	}
	if rows, _ = s.UnackedDeliveries(ctx, []string{"fp-other"}); len(rows) != 1 || !rows[0].Acking {
		t.Fatalf("row not marked acking: %+v", rows)
	}
	if ok, err := s.ClaimDelivery(ctx, "id-3", "live", "thief"); ok || err != nil {
		t.Fatalf("acking row claimed: %v %v", ok, err)
	}
	// Unmarked (its ack was not sent): claimable again; marked again, then
	// deleted by the next mark.
	if err := s.DeliveriesNotAcked(ctx, "live", []string{"id-3"}); err != nil {
		t.Fatal(err)
	}
	if rows, _ = s.UnackedDeliveries(ctx, []string{"fp-other"}); len(rows) != 1 || rows[0].Acking {
		t.Fatalf("row still acking: %+v", rows)
	}
	if ok, err := s.TakeAckingDelivery(ctx, "id-3", "live"); ok || err != nil {
		t.Fatalf("a row not acking taken: %v %v", ok, err)
	}
	if err := s.DeliveriesAcking(ctx, "live", []string{"id-3"}); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.TakeAckingDelivery(ctx, "id-3", "another"); ok || err != nil {
		t.Fatalf("another session's acking row taken: %v %v", ok, err)
	}
	if err := s.DeliveriesAcking(ctx, "live", nil); err != nil {
		t.Fatal(err)
	}
	if rows, _ = s.UnackedDeliveries(ctx, []string{"fp-other"}); len(rows) != 0 {
		t.Fatalf("acked row kept: %+v", rows)
	}
	// An acking row of a session that died is taken once (a matching
	// redelivery is stored again, flagged).
	if err := s.WriteDeliveries(ctx, nil, nil, []deliverylog.Delivery{d("id-4", "fp-4", "died")}); err != nil {
		t.Fatal(err)
	}
	if err := s.DeliveriesAcking(ctx, "died", []string{"id-4"}); err != nil {
		t.Fatal(err)
	}
	for i, want := range []bool{true, false} {
		if ok, err := s.TakeAckingDelivery(ctx, "id-4", "died"); ok != want || err != nil {
			t.Fatalf("take %d: %v %v, want %v", i+1, ok, err, want)
		}
	}
	// A row older than a day (its Consumer died for good) is pruned by the
	// next DeliveriesAcking of any session.
	if _, err := st.pool.Exec(ctx, `UPDATE `+st.q.unacked+` SET since = now() - interval '25 hours' WHERE arrival_id = 'id-2'`); err != nil {
		t.Fatal(err)
	}
	if err := s.DeliveriesAcking(ctx, "anyone", nil); err != nil {
		t.Fatal(err)
	}
	rows, _ = s.UnackedDeliveries(ctx, []string{"fp-same"})
	if len(rows) != 1 || rows[0].ArrivalID != "id-1" {
		t.Fatalf("rows after the prune: %+v", rows)
	}
}
