package pgstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// testSchema returns a schema name of its own for the test and drops the
// schema (CASCADE) at the end.
func testSchema(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "rrtest_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	return schema
}

// testPool connects to the test PostgreSQL (skips/fails like testkit.HavePG).
func testPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	dsn := testkit.HavePG(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatalf("pgxpool.New: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// newTestStore returns a migrated Store in a schema of its own.
func newTestStore(t testing.TB) *Store {
	t.Helper()
	pool := testPool(t)
	schema := testSchema(t, pool)
	s, err := New(context.Background(), Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

var t0 = time.Date(2026, 11, 24, 9, 0, 0, 0, time.UTC)

func arrival(mid string, at time.Time) audit.Arrival {
	return audit.Arrival{
		ID: "arr-" + mid, MessageID: mid, Exchange: "orders", RoutingKey: "order.created",
		ArrivedAt: at, PublishedAt: at.Add(-time.Millisecond),
		Headers:    map[string]any{"tenant": "acme"},
		Properties: map[string]string{"content-type": "application/json"},
		Body:       []byte(`{"id":"` + mid + `"}`), BodySize: len(`{"id":"` + mid + `"}`),
	}
}

func attempt(mid string, n int, at time.Time, o audit.Outcome) audit.Attempt {
	a := audit.Attempt{
		ID: fmt.Sprintf("att-%s-%d", mid, n), MessageID: mid, Queue: "orders-q", Attempt: n,
		StartedAt: at, Duration: 1500 * time.Microsecond, Outcome: o,
	}
	if o != audit.OutcomeSuccess {
		a.ErrorClass, a.Error = "transient", "dial tcp: connection refused"
	}
	if o == audit.OutcomeRetry {
		a.Delay, a.Tier = 2*time.Second, 5*time.Second
	}
	return a
}

// counts returns the row counts of the three tables.
func counts(t testing.TB, s *Store) (arr, att, msg int64) {
	t.Helper()
	st, err := s.Stats(context.Background())
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	return st.Arrivals, st.Attempts, st.Messages
}

// Filter0 is the empty filter.
func Filter0() audit.Filter { return audit.Filter{} }

// PGDSNForTest is testkit.HavePG.
func PGDSNForTest(t testing.TB) string { return testkit.HavePG(t) }
