package testkit

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// DefaultPGDSN is used when RABBITRETRY_PG_DSN is unset: the database
// `test` of the local PostgreSQL as user postgres (trust authentication),
// what scripts/ensure-postgres.sh provides.
const DefaultPGDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

var (
	pgOnce    sync.Once
	pgDialErr error
)

// PGDSN returns $RABBITRETRY_PG_DSN or DefaultPGDSN, without checking it.
func PGDSN() string {
	if v := os.Getenv("RABBITRETRY_PG_DSN"); v != "" {
		return v
	}
	return DefaultPGDSN
}

// HavePG returns PGDSN after connecting to it once per test binary (5 s
// timeout); if that failed, the test fails when CI=true (so CI never skips
// the PostgreSQL tests silently) and is skipped otherwise, like URI for
// the broker.
func HavePG(t testing.TB) string {
	t.Helper()
	dsn := PGDSN()
	pgOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			pgDialErr = err
			return
		}
		pgDialErr = conn.Ping(ctx)
		_ = conn.Close(ctx)
	})
	if pgDialErr != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL at %s unreachable: %v", RedactPGDSN(dsn), pgDialErr)
		}
		t.Skipf("PostgreSQL at %s unreachable (set RABBITRETRY_PG_DSN, or run scripts/ensure-postgres.sh): %v", RedactPGDSN(dsn), pgDialErr)
	}
	return dsn
}

// RedactPGDSN hides the password of a DSN (URL or key=value) for log
// output.
func RedactPGDSN(dsn string) string {
	return redact.URI(dsn)
}
