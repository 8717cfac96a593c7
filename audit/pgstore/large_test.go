package pgstore

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
)

// TestSearchLatencyLarge measures Search on a large store: set
// RABBITRETRY_PG_LARGE to the number of messages (e.g. 200000; each gets an
// arrival and two attempts, generated in SQL). Skipped otherwise.
func TestSearchLatencyLarge(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("RABBITRETRY_PG_LARGE"))
	if n <= 0 {
		t.Skip("set RABBITRETRY_PG_LARGE=<messages> to measure Search on a large store")
	}
	s := newTestStore(t)
	ctx := context.Background()
	start := time.Now()
	for _, sql := range []string{
		`INSERT INTO ` + s.q.arrivals + ` (id, message_id, correlation_id, exchange, routing_key, arrived_at, headers, body, body_size)
		SELECT 'a'||i, 'm'||i, 'c'||i, 'ex'||(i % 5), 'rk'||(i % 50), $2::timestamptz - i * interval '1 second',
		       jsonb_build_object('tenant', 't' || (i % 100), 'seq', i), convert_to(repeat('x', 200), 'UTF8'), 200
		FROM generate_series(1, $1::int) i`,
		`INSERT INTO ` + s.q.attempts + ` (id, message_id, correlation_id, queue, attempt, started_at, duration_us, outcome, error_class, error)
		SELECT 't'||i||'-'||k, 'm'||i, 'c'||i, 'q'||(i % 10), k, $2::timestamptz - i * interval '1 second' + k * interval '1 second', 1000,
		       CASE WHEN k = 1 THEN 'retry' WHEN i % 97 = 0 THEN 'poisoned' ELSE 'success' END,
		       CASE WHEN k = 1 THEN 'transient' WHEN i % 97 = 0 THEN 'exhausted' ELSE '' END,
		       CASE WHEN k = 1 THEN 'upstream ' || md5(i::text) || ' failed' ELSE '' END
		FROM generate_series(1, $1::int) i, generate_series(1, 2) k`,
		`INSERT INTO ` + s.q.messages + ` (message_id, first_arrival_at, first_started_at, last_attempt, last_started_at, last_attempt_id, last_outcome)
		SELECT a.message_id, a.arrived_at, t.started_at, 2, t.started_at, t.id, t.outcome
		FROM ` + s.q.arrivals + ` a JOIN ` + s.q.attempts + ` t ON t.message_id = a.message_id AND t.attempt = 2
		WHERE $1::int > 0 AND $2::timestamptz IS NOT NULL`,
		`ANALYZE ` + s.q.arrivals, `ANALYZE ` + s.q.attempts, `ANALYZE ` + s.q.messages,
	} {
		var err error
		if strings.Contains(sql, "$1") {
			_, err = s.pool.Exec(ctx, sql, n, t0)
		} else {
			_, err = s.pool.Exec(ctx, sql)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("generated %d messages (%d arrivals, %d attempts) in %v", n, n, 2*n, time.Since(start).Round(time.Millisecond))
	var needle string
	_ = s.pool.QueryRow(ctx, `SELECT substr(md5('4242'), 3, 10)`).Scan(&needle)
	for _, c := range []struct {
		name string
		f    audit.Filter
	}{
		{"no filter", audit.Filter{}},
		{"MessageID", audit.Filter{MessageID: "m4242"}},
		{"CorrelationID", audit.Filter{CorrelationID: "c4242"}},
		{"From/To 1h", audit.Filter{From: t0.Add(-2 * time.Hour), To: t0.Add(-time.Hour)}},
		{"Queue", audit.Filter{Queue: "q3"}},
		{"Exchange+RoutingKey", audit.Filter{Exchange: "ex2", RoutingKey: "rk7"}},
		{"Headers 1%", audit.Filter{Headers: map[string]any{"tenant": "t42"}}},
		{"Headers 1 row", audit.Filter{Headers: map[string]any{"seq": 4242}}},
		{"Outcome poisoned", audit.Filter{Outcome: audit.OutcomePoisoned}},
		{"LastOutcome poisoned", audit.Filter{LastOutcome: audit.OutcomePoisoned}},
		{"ErrorClass exhausted", audit.Filter{ErrorClass: "exhausted"}},
		{"ErrorContains 1 row", audit.Filter{ErrorContains: needle}},
		{"ErrorContains all", audit.Filter{ErrorContains: "upstream"}},
		{"Queue+Outcome+From", audit.Filter{Queue: "q3", Outcome: audit.OutcomePoisoned, From: t0.Add(-24 * time.Hour)}},
	} {
		for _, limit := range []int{100} {
			c.f.Limit = limit
			start := time.Now()
			got, next, err := s.SearchPage(ctx, c.f)
			if err != nil {
				t.Fatal(err)
			}
			first := time.Since(start)
			var deep time.Duration
			if next != "" { // a page deep in the results
				f := c.f
				f.After = next
				for range 5 {
					start = time.Now()
					_, nx, err := s.SearchPage(ctx, f)
					if err != nil {
						t.Fatal(err)
					}
					deep = time.Since(start)
					if nx == "" {
						break
					}
					f.After = nx
				}
			}
			// Prepared statements switch to a generic plan after 5 runs:
			// time the 8th run of the first page too.
			var generic time.Duration
			for range 7 {
				start = time.Now()
				if _, _, err := s.SearchPage(ctx, c.f); err != nil {
					t.Fatal(err)
				}
				generic = time.Since(start)
			}
			t.Logf("SEARCH %-22s limit %d: %3d messages, first page %6.1f ms (8th run %6.1f ms), 6th page %6.1f ms",
				c.name, limit, len(got), ms(first), ms(generic), ms(deep))
		}
	}
	if os.Getenv("RABBITRETRY_PG_EXPLAIN") != "" {
		var keys []string
		rows, _ := s.pool.Query(ctx, `SELECT message_id FROM `+s.q.messages+` ORDER BY message_time LIMIT 5000`)
		for rows.Next() {
			var k string
			_ = rows.Scan(&k)
			keys = append(keys, k)
		}
		rows.Close()
		t.Log(explain(t, s, "ANALYZE "+s.q.rebuildMessages, []any{keys}))
		for _, f := range []audit.Filter{{Outcome: audit.OutcomePoisoned}, {Exchange: "ex2", RoutingKey: "rk7"}, {Headers: map[string]any{"tenant": "t42"}}} {
			sql, args, _, err := s.searchSQL(f)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%+v:\n%s", f, explain(t, s, "ANALYZE "+sql, args))
		}
	}
	start = time.Now()
	res, err := s.Prune(ctx, t0.Add(-time.Duration(n/2)*time.Second), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("PRUNE half: %+v in %v", res, time.Since(start).Round(time.Millisecond))
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
