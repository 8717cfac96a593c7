package pgstore

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/rabbitretry/rabbitretry/audit"
)

// fixture: four messages covering every Filter field.
//
//	m-a  arrival orders/order.created {tenant:acme,region:eu} corr c-a at t0;
//	     attempts q1: 1 retry (transient, "dial: Connection REFUSED"), 2 success
//	m-b  arrival payments/payment.done {tenant:globex} at t0+1m;
//	     attempt q2: 1 poisoned (permanent, "invalid amount 42%")
//	m-c  no arrival; attempt q1 at t0+2m: 1 retry (transient, "timeout_x"), corr c-c
//	m-d  arrival orders/order.deleted {tenant:acme,n:1} at t0+3m; no attempt
func searchFixture(t *testing.T) *Store {
	t.Helper()
	s := newTestStore(t)
	m := time.Minute
	aA := arrival("m-a", t0)
	aA.CorrelationID = "c-a"
	aA.Headers = map[string]any{"tenant": "acme", "region": "eu"}
	aB := arrival("m-b", t0.Add(m))
	aB.Exchange, aB.RoutingKey, aB.Headers = "payments", "payment.done", map[string]any{"tenant": "globex"}
	aD := arrival("m-d", t0.Add(3*m))
	aD.RoutingKey, aD.Headers = "order.deleted", map[string]any{"tenant": "acme", "n": 1}

	tA1 := attempt("m-a", 1, t0.Add(time.Second), audit.OutcomeRetry)
	tA1.Queue, tA1.Error = "q1", "dial: Connection REFUSED"
	tA2 := attempt("m-a", 2, t0.Add(5*time.Second), audit.OutcomeSuccess)
	tA2.Queue = "q1"
	tB1 := attempt("m-b", 1, t0.Add(m+time.Second), audit.OutcomePoisoned)
	tB1.Queue, tB1.ErrorClass, tB1.Error = "q2", "permanent", "invalid amount 42%"
	tC1 := attempt("m-c", 1, t0.Add(2*m), audit.OutcomeRetry)
	tC1.Queue, tC1.Error, tC1.CorrelationID = "q1", "timeout_x", "c-c"
	if err := s.Write(context.Background(), []audit.Arrival{aA, aB, aD}, []audit.Attempt{tA1, tA2, tB1, tC1}); err != nil {
		t.Fatal(err)
	}
	return s
}

func ids(msgs []audit.Message) []string {
	out := []string{}
	for _, m := range msgs {
		out = append(out, m.MessageID)
	}
	return out
}

// One subtest per Filter field: a filter that matches, and a control that
// must match nothing (or less).
func TestSearchFilterFields(t *testing.T) {
	s := searchFixture(t)
	m := time.Minute
	type c struct {
		name string
		f    audit.Filter
		want []string
	}
	cases := []c{
		{"none", audit.Filter{}, []string{"m-d", "m-c", "m-b", "m-a"}},
		{"MessageID", audit.Filter{MessageID: "m-b"}, []string{"m-b"}},
		{"MessageID/control", audit.Filter{MessageID: "m-x"}, nil},
		{"CorrelationID/arrival", audit.Filter{CorrelationID: "c-a"}, []string{"m-a"}},
		{"CorrelationID/attempt", audit.Filter{CorrelationID: "c-c"}, []string{"m-c"}},
		{"CorrelationID/control", audit.Filter{CorrelationID: "c-zz"}, nil},
		{"From", audit.Filter{From: t0.Add(m)}, []string{"m-d", "m-c", "m-b"}},
		{"To", audit.Filter{To: t0.Add(m)}, []string{"m-a"}},
		{"FromTo", audit.Filter{From: t0.Add(m), To: t0.Add(2 * m)}, []string{"m-b"}},
		{"From/control", audit.Filter{From: t0.Add(10 * m)}, nil},
		{"To/control", audit.Filter{To: t0}, nil},
		{"Queue", audit.Filter{Queue: "q1"}, []string{"m-c", "m-a"}},
		{"Queue/control", audit.Filter{Queue: "q9"}, nil},
		{"Exchange", audit.Filter{Exchange: "orders"}, []string{"m-d", "m-a"}},
		{"Exchange/control", audit.Filter{Exchange: "nope"}, nil},
		{"RoutingKey", audit.Filter{RoutingKey: "order.created"}, []string{"m-a"}},
		{"RoutingKey/control-same-arrival", audit.Filter{Exchange: "orders", RoutingKey: "payment.done"}, nil},
		{"Outcome", audit.Filter{Outcome: audit.OutcomeRetry}, []string{"m-c", "m-a"}},
		{"Outcome/success", audit.Filter{Outcome: audit.OutcomeSuccess}, []string{"m-a"}},
		{"Outcome/control", audit.Filter{Outcome: audit.OutcomeDropped}, nil},
		{"LastOutcome", audit.Filter{LastOutcome: audit.OutcomeRetry}, []string{"m-c"}},
		{"LastOutcome/poisoned", audit.Filter{LastOutcome: audit.OutcomePoisoned}, []string{"m-b"}},
		{"LastOutcome/control", audit.Filter{LastOutcome: audit.OutcomeNacked}, nil},
		{"ErrorClass", audit.Filter{ErrorClass: "permanent"}, []string{"m-b"}},
		{"ErrorClass/control", audit.Filter{ErrorClass: "malformed"}, nil},
		{"ErrorContains/case", audit.Filter{ErrorContains: "connection refused"}, []string{"m-a"}},
		{"ErrorContains/percent-literal", audit.Filter{ErrorContains: "42%"}, []string{"m-b"}},
		{"ErrorContains/underscore-literal", audit.Filter{ErrorContains: "out_x"}, []string{"m-c"}},
		{"ErrorContains/control-wildcards", audit.Filter{ErrorContains: "o%x"}, nil},
		{"ErrorContains/control-underscore", audit.Filter{ErrorContains: "timeout_y"}, nil},
		{"Headers", audit.Filter{Headers: map[string]any{"tenant": "acme"}}, []string{"m-d", "m-a"}},
		{"Headers/two-keys", audit.Filter{Headers: map[string]any{"tenant": "acme", "n": 1}}, []string{"m-d"}},
		{"Headers/control", audit.Filter{Headers: map[string]any{"tenant": "initech"}}, nil},
		{"Headers/control-type", audit.Filter{Headers: map[string]any{"n": "1"}}, nil},
		{"Attempt-fields-same-attempt", audit.Filter{Queue: "q1", Outcome: audit.OutcomeSuccess}, []string{"m-a"}},
		{"Attempt-fields-same-attempt/control", audit.Filter{Queue: "q2", Outcome: audit.OutcomeSuccess}, nil},
		{"Mixed", audit.Filter{Exchange: "orders", Queue: "q1", From: t0, To: t0.Add(m)}, []string{"m-a"}},
		{"Limit", audit.Filter{Limit: 2}, []string{"m-d", "m-c"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := s.Search(context.Background(), c.f)
			if err != nil {
				t.Fatal(err)
			}
			want := c.want
			if want == nil {
				want = []string{}
			}
			if !slices.Equal(ids(got), want) {
				t.Fatalf("Search(%+v) = %v, want %v", c.f, ids(got), want)
			}
		})
	}
	// Whole messages come back: m-a with its arrival and both attempts,
	// oldest first; m-c without arrival.
	got, _ := s.Search(context.Background(), audit.Filter{Queue: "q1"})
	if got[1].Arrival == nil || got[1].Arrival.ID != "arr-m-a" || len(got[1].Attempts) != 2 ||
		got[1].Attempts[0].Attempt != 1 || got[1].Attempts[1].Attempt != 2 {
		t.Fatalf("m-a = %+v", got[1])
	}
	if got[0].Arrival != nil || len(got[0].Attempts) != 1 {
		t.Fatalf("m-c = %+v", got[0])
	}
}

func TestSearchBadFilter(t *testing.T) {
	s := newTestStore(t)
	for _, c := range []struct {
		f    audit.Filter
		want string
	}{
		{audit.Filter{Limit: -1}, "Filter.Limit"},
		{audit.Filter{Limit: maxLimit + 1}, "Filter.Limit"},
		{audit.Filter{After: "garbage"}, "Filter.After"},
		{audit.Filter{After: cursorPrefix + "!!"}, "Filter.After"},
		{audit.Filter{From: t0, To: t0}, "Filter.From"},
		{audit.Filter{Headers: map[string]any{"c": make(chan int)}}, "Filter.Headers"},
	} {
		if _, err := s.Search(context.Background(), c.f); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Search(%+v) = %v, want an error naming %s", c.f, err, c.want)
		}
	}
	if _, err := s.Search(context.Background(), audit.Filter{Limit: maxLimit}); err != nil {
		t.Errorf("Limit=maxLimit: %v", err)
	}
}

// Paging through 1,234 messages (groups of 7 share a timestamp, so the
// message id breaks ties), with SearchPage's cursor and with cursorOf(m),
// returns every message exactly once, newest first; the default limit is
// 100.
func TestSearchPagination(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	const n = 1234
	var arr []audit.Arrival
	var att []audit.Attempt
	want := map[string]bool{}
	for i := range n {
		mid := fmt.Sprintf("p-%04d", i)
		want[mid] = true
		at := t0.Add(time.Duration(i/7) * time.Second)
		if i%3 == 0 { // no arrival: timed by its attempt
			att = append(att, attempt(mid, 1, at, audit.OutcomeSuccess))
			continue
		}
		arr = append(arr, arrival(mid, at))
		att = append(att, attempt(mid, 1, at.Add(time.Hour), audit.OutcomeSuccess))
	}
	if err := s.Write(ctx, arr, att); err != nil {
		t.Fatal(err)
	}
	first, err := s.Search(ctx, audit.Filter{})
	if err != nil || len(first) != defaultLimit {
		t.Fatalf("default page: %d messages, %v; want %d", len(first), err, defaultLimit)
	}
	for _, mode := range []string{"SearchPage", "cursorOf"} {
		seen := map[string]int{}
		var order []string
		f := audit.Filter{Limit: 100}
		pages := 0
		for {
			var page []audit.Message
			var next string
			var err error
			if mode == "SearchPage" {
				page, next, err = s.SearchPage(ctx, f)
			} else {
				page, err = s.Search(ctx, f)
				if len(page) == f.Limit {
					next, err = cursorOf(page[len(page)-1])
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			pages++
			for _, m := range page {
				seen[m.MessageID]++
				order = append(order, m.MessageID)
			}
			if next == "" {
				break
			}
			f.After = next
		}
		dups := 0
		for _, c := range seen {
			dups += c - 1
		}
		missing := 0
		for mid := range want {
			if seen[mid] == 0 {
				missing++
			}
		}
		t.Logf("ACCOUNT %s/%s: written=%d pages=%d returned=%d distinct=%d duplicates=%d lost=%d",
			t.Name(), mode, n, pages, len(order), len(seen), dups, missing)
		if dups != 0 || missing != 0 || len(seen) != n || pages != 13 {
			t.Fatalf("%s: %d distinct of %d, duplicates %d, missing %d, pages %d", mode, len(seen), n, dups, missing, pages)
		}
		// Newest first: indexes fall by time group, ids descending within.
		for i := 1; i < len(order); i++ {
			var a, b int
			fmt.Sscanf(order[i-1], "p-%d", &a)
			fmt.Sscanf(order[i], "p-%d", &b)
			if a/7 < b/7 || (a/7 == b/7 && a < b) {
				t.Fatalf("%s: %s before %s breaks newest-first", mode, order[i-1], order[i])
			}
		}
	}
	// A filtered walk: only the messages with an arrival.
	f := audit.Filter{Exchange: "orders", Limit: 250}
	total := 0
	for {
		page, next, err := s.SearchPage(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		total += len(page)
		if next == "" {
			break
		}
		f.After = next
	}
	if total != len(arr) {
		t.Fatalf("filtered walk returned %d, want %d", total, len(arr))
	}
}

// Headers (jsonb containment) is served by the GIN jsonb_path_ops index:
// 20,000 arrivals, one matching tenant, and the Search query's plan uses
// arrivals_headers_idx.
func TestSearchHeadersUsesGINIndex(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	_, err := s.pool.Exec(ctx, `INSERT INTO `+s.q.arrivals+` (id, message_id, exchange, routing_key, arrived_at, headers, body, body_size)
		SELECT 'a'||i, 'm'||i, 'orders', 'rk', now() - i * interval '1 second',
		       jsonb_build_object('tenant', 't' || (i % 500), 'seq', i), '\x00'::bytea, 1
		FROM generate_series(1, 20000) i`)
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.pool.Exec(ctx, `INSERT INTO `+s.q.messages+` (message_id, first_arrival_at)
		SELECT message_id, arrived_at FROM `+s.q.arrivals)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.pool.Exec(ctx, `ANALYZE `+s.q.arrivals+`; ANALYZE `+s.q.messages); err != nil {
		t.Fatal(err)
	}
	f := audit.Filter{Headers: map[string]any{"seq": 12345}}
	sql, args, _, err := s.searchSQL(f)
	if err != nil {
		t.Fatal(err)
	}
	plan := explain(t, s, sql, args)
	if !strings.Contains(plan, "arrivals_headers_idx") {
		t.Fatalf("plan of a header search does not use arrivals_headers_idx:\n%s", plan)
	}
	got, err := s.Search(ctx, f)
	if err != nil || len(got) != 1 || got[0].MessageID != "m12345" {
		t.Fatalf("Search = %v, %v; want m12345", ids(got), err)
	}
	// ErrorContains has its trigram index when pg_trgm is available: the
	// plan of an ErrorContains search over 20,000 attempts uses it.
	st, err := s.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !st.TrigramIndex {
		t.Logf("pg_trgm not available: ErrorContains scans (not checked)")
		return
	}
	_, err = s.pool.Exec(ctx, `INSERT INTO `+s.q.attempts+` (id, message_id, queue, attempt, started_at, outcome, error_class, error)
		SELECT 't'||i, 'm'||i, 'q', 1, now() - i * interval '1 second', 'retry', 'transient',
		       'upstream ' || md5(i::text) || ' failed'
		FROM generate_series(1, 20000) i;
		ANALYZE `+s.q.attempts)
	if err != nil {
		t.Fatal(err)
	}
	var needle string
	if err := s.pool.QueryRow(ctx, `SELECT substr(md5('777'), 5, 12)`).Scan(&needle); err != nil {
		t.Fatal(err)
	}
	f = audit.Filter{ErrorContains: strings.ToUpper(needle)}
	sql, args, _, err = s.searchSQL(f)
	if err != nil {
		t.Fatal(err)
	}
	// On 20,000 short rows a sequential scan is as cheap, so the planner
	// picks either; check that the index serves the query when scans are
	// discouraged (it would not appear at all if ILIKE could not use it).
	if plan := explainNoSeqScan(t, s, sql, args); !strings.Contains(plan, "attempts_error_trgm_idx") {
		t.Fatalf("plan of an ErrorContains search (enable_seqscan=off) does not use attempts_error_trgm_idx:\n%s", plan)
	}
	got, err = s.Search(ctx, f)
	if err != nil || len(got) != 1 || got[0].MessageID != "m777" {
		t.Fatalf("Search(ErrorContains) = %v, %v; want m777", ids(got), err)
	}
}

func explainNoSeqScan(t *testing.T, s *Store, sql string, args []any) string {
	t.Helper()
	ctx := context.Background()
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off`); err != nil {
		t.Fatal(err)
	}
	return explainQ(t, tx, sql, args)
}

type querier interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}

func explain(t *testing.T, s *Store, sql string, args []any) string {
	t.Helper()
	return explainQ(t, s.pool, sql, args)
}

func explainQ(t *testing.T, s querier, sql string, args []any) string {
	t.Helper()
	rows, err := s.Query(context.Background(), "EXPLAIN "+sql, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		b.WriteString(line + "\n")
	}
	return b.String()
}
