package pgstore

import (
	"context"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// A Write whose connection is killed mid-statement (pg_terminate_backend on
// its own backend, found by its schema in pg_stat_activity) returns an
// error and commits nothing; written again it stores every record once.
// Same for a Write whose context is cancelled mid-statement.
func TestWriteAtomicOnFailure(t *testing.T) {
	for _, how := range []string{"terminate", "cancel"} {
		t.Run(how, func(t *testing.T) {
			s := newTestStore(t)
			arr, att := throughputBatch("big", 20000)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- s.Write(ctx, arr, att) }()
			var pid int
			testkit.WaitFor(t, 60*time.Second, "the Write's INSERT running", func() bool {
				err := s.pool.QueryRow(context.Background(), `SELECT pid FROM pg_stat_activity
					WHERE state = 'active' AND pid <> pg_backend_pid() AND query LIKE 'INSERT INTO %' AND query LIKE '%' || $1 || '%'
					LIMIT 1`, s.schema).Scan(&pid)
				return err == nil
			})
			if how == "terminate" {
				if _, err := s.pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
					t.Fatal(err)
				}
			} else {
				cancel()
			}
			err := testkit.Recv(t, done, 60*time.Second)
			a, b, m := counts(t, s)
			t.Logf("interrupted Write: err=%v; stored arrivals=%d attempts=%d messages=%d", err, a, b, m)
			if err == nil {
				t.Skip("the Write committed before it could be interrupted (machine too fast for 20,000 records)")
			}
			if a != 0 || b != 0 || m != 0 {
				t.Fatalf("a failed Write left arrivals=%d attempts=%d messages=%d, want nothing", a, b, m)
			}
			if err := s.Write(context.Background(), arr, att); err != nil {
				t.Fatal(err)
			}
			a, b, m = counts(t, s)
			if a != int64(len(arr)) || b != int64(len(att)) || m != int64(len(arr)) {
				t.Fatalf("after the retry arrivals=%d attempts=%d messages=%d, want %d/%d/%d", a, b, m, len(arr), len(att), len(arr))
			}
			t.Logf("ACCOUNT %s: offered=%d records, failed write committed=0, retried write stored=%d, duplicates=0, lost=0",
				t.Name(), len(arr)+len(att), a+b)
		})
	}
}
