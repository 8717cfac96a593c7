package pgstore

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

// TestWriteRejectsForGood: a record PostgreSQL can never take fails Write
// with audit.ErrRecordRejected (checked before the database: an indexed
// value over maxIndexedBytes, a time outside years 1-9999), the database's
// own data exceptions (class 22) and limits (54) too; other errors stay
// temporary. SetAside keeps such a record with its reason, idempotently,
// and Stats shows it.
func TestWriteRejectsForGood(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	long := arrival(strings.Repeat("m", 8000), t0)
	future := arrival("future", t0)
	future.PublishedAt = time.Unix(1e13, 0)
	longQueue := attempt("q", 1, t0, audit.OutcomeSuccess)
	longQueue.Queue = strings.Repeat("q", maxIndexedBytes+1)
	for name, w := range map[string]func() error{
		"8000-byte message id": func() error { return s.Write(ctx, []audit.Arrival{arrival("ok", t0), long}, nil) },
		"timestamp 10^13 s":    func() error { return s.Write(ctx, []audit.Arrival{future}, nil) },
		"long queue name":      func() error { return s.Write(ctx, nil, []audit.Attempt{longQueue}) },
	} {
		if err := w(); !errors.Is(err, audit.ErrRecordRejected) {
			t.Errorf("%s: Write = %v, want ErrRecordRejected", name, err)
		}
	}
	if arr, _, _ := counts(t, s); arr != 0 {
		t.Fatalf("%d arrivals stored from rejected batches", arr)
	}
	for code, want := range map[string]bool{"54000": true, "22008": true, "22021": true, "08006": false, "40001": false, "53100": false, "57P01": false} {
		if got := permanent(&pgconn.PgError{Code: code}); got != want {
			t.Errorf("permanent(SQLSTATE %s) = %v, want %v", code, got, want)
		}
	}
	if permanent(errors.New("connection reset")) {
		t.Error("a non-PostgreSQL error taken as permanent")
	}
	rec := audit.SetAside{Kind: auditconst.KindArrival, RecordID: long.ID, MessageID: long.MessageID, Reason: "too long", Record: []byte(`{}`)}
	for range 2 {
		if err := s.SetAside(ctx, []audit.SetAside{rec}); err != nil {
			t.Fatal(err)
		}
	}
	st, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.SetAside != 1 || len(st.SetAsideRecent) != 1 || st.SetAsideRecent[0].Reason != "too long" || len(st.SetAsideRecent[0].MessageID) != 256 {
		t.Fatalf("stats: %d %+v", st.SetAside, st.SetAsideRecent)
	}
}
