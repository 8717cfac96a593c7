package httpapi_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/url"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/httpapi"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/internal/auditparse"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// pgStore returns a migrated pgstore.Store in a schema of its own, dropped
// at the end.
func pgStore(t testing.TB) *pgstore.Store {
	t.Helper()
	dsn := testkit.HavePG(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "rrapi_" + hex.EncodeToString(b[:])
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`) })
	st, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A NUL byte, invalid UTF-8 or a cursor that is not one, in any query
// parameter or message id, is a 400 with a message naming the parameter,
// on the real PostgreSQL store: never a 500, never the database's text
// (issue 19 item 11). The database's text of a real failure goes to the
// server log only.
func TestBadInputIs400WithoutDatabaseText(t *testing.T) {
	st := pgStore(t)
	logs := &syncBuffer{}
	rs, err := audit.NewResender(audit.ResenderConfig{URI: "amqp://guest:guest@127.0.0.1:1/", Store: st}) // dry runs only: never connects
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, httpapi.Config{Store: st, Logger: watermill.NewStdLoggerWithOut(logs, false, false),
		EnableResend: true, ResendToken: token, Resend: rs.Resend})
	dbWords := []string{"SQLSTATE", "ERROR:", "invalid byte sequence", "pgstore", "pgx", "unsupported Unicode"}
	for _, q := range []string{
		"message_id=a%00b", "message_id=%ff%fe", "correlation_id=x%00", "queue=%c3%28", "exchange=%00",
		"routing_key=%e2%82", "error_contains=%00", "error_class=%80", "header=tenant=%00", "header=%ff=1",
		`header=t={"a":"%00"}`, "after=garbage", "after=c1.%ff", "after=c1.bm90LWEtY3Vyc29y", "after=c1.MTIzOmFi%00",
	} {
		code, body := do(t, "GET", srv.URL+"/v1/messages?"+q, "", "")
		if code != 400 {
			t.Errorf("GET ?%s: %d %s, want 400", q, code, body)
		}
		for _, w := range dbWords {
			if strings.Contains(string(body), w) {
				t.Errorf("GET ?%s: database text %q in the response %s", q, w, body)
			}
		}
	}
	for _, id := range []string{"a%00b", "%ff%fe"} {
		code, body := do(t, "GET", srv.URL+"/v1/messages/"+id, "", "")
		if code != 400 {
			t.Errorf("GET /v1/messages/%s: %d %s, want 400", id, code, body)
		}
	}
	for _, f := range []string{`{"message_id":"a\u0000b"}`, `{"queue":"q","after":"garbage"}`, `{"headers":{"t":"\u0000"}}`} {
		code, body := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, `{"mode":"to-exchange","dry_run":true,"filter":`+f+`}`)
		if code != 400 {
			t.Errorf("POST resend filter %s: %d %s, want 400", f, code, body)
		}
	}
	// A real database failure: 500 with no database text; the text in the
	// log.
	st2, err := pgstore.New(context.Background(), pgstore.Config{DSN: testkit.HavePG(t), Schema: st.Schema(), SkipMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	st2.Close()
	srv2 := serve(t, httpapi.Config{Store: st2, Logger: watermill.NewStdLoggerWithOut(logs, false, false)})
	code, body := do(t, "GET", srv2.URL+"/v1/messages?"+url.Values{"queue": {"q"}}.Encode(), "", "")
	if code != 500 || strings.Contains(string(body), "closed pool") {
		t.Errorf("closed pool: %d %s, want 500 without the database's text", code, body)
	}
	if !strings.Contains(logs.String(), "closed pool") {
		t.Errorf("closed pool: the server log lacks the database's error: %s", logs.String())
	}
}

// Over HTTP a broad resend (here a time range from 1970, which selects
// every message) is a 400 without allow_all, a 400 with allow_all but no
// expected_count, a 409 with a wrong expected_count, and nothing is sent
// (the resender's broker is unreachable: any publish would be a 500); a
// dry run tells the count (issue 19 item 10).
func TestResendBreadthOverHTTP(t *testing.T) {
	st := pgStore(t)
	var arr []audit.Arrival
	for i := range 15 {
		id := "b-" + strconv.Itoa(i)
		arr = append(arr, audit.Arrival{ID: "arr-" + id, MessageID: id, Exchange: "orders", RoutingKey: "k",
			ArrivedAt: time.Now().UTC().Add(-time.Duration(i) * time.Second), Body: []byte(id), BodySize: len(id)})
	}
	if err := st.Write(context.Background(), arr, nil); err != nil {
		t.Fatal(err)
	}
	rs, err := audit.NewResender(audit.ResenderConfig{URI: "amqp://guest:guest@127.0.0.1:1/", Store: st})
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, httpapi.Config{Store: st, EnableResend: true, ResendToken: token, Resend: rs.Resend})
	post := func(body string) (int, string) {
		code, b := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, body)
		return code, string(b)
	}
	const f = `"filter":{"from":"1970-01-01T00:00:00Z"},"mode":"to-exchange"`
	for _, c := range []struct {
		body string
		code int
		want string
	}{
		{`{` + f + `}`, 400, "too many"},
		{`{` + f + `,"allow_all":true}`, 400, "expected_count"},
		{`{` + f + `,"allow_all":true,"expected_count":14}`, 409, "15 matched, 14 expected"},
		{`{` + f + `,"dry_run":true}`, 200, `"matched": 15`},
		{`{"filter":{"message_id":"b-3"},"mode":"to-exchange","dry_run":true}`, 200, `"matched": 1`},
	} {
		if code, b := post(c.body); code != c.code || !strings.Contains(b, c.want) {
			t.Errorf("%s: %d %s, want %d with %q", c.body, code, b, c.code, c.want)
		}
	}
}

// GET /v1/messages at the maximum limit (10,000) over messages with 256
// KiB bodies: the response streams, carries no body, and the process's
// peak heap stays under 100 MiB (issue 19 item 12: it was 1.9 MiB per
// message, ≈ 18 GiB). The rows are made by PostgreSQL itself
// (generate_series; TOAST compresses the bodies), so the test moves no
// gigabytes.
func TestSearchAtMaxLimitStreamsWithoutBodies(t *testing.T) {
	st := pgStore(t)
	ctx := context.Background()
	const n, bodySize = httpapi.MaxLimit, 256 << 10
	s := st.Schema()
	start := time.Now()
	// lz4 (if this PostgreSQL has it) compresses the generated bodies far
	// faster than the default pglz.
	_, _ = st.Pool().Exec(ctx, `ALTER TABLE `+s+`.arrivals ALTER COLUMN body SET COMPRESSION lz4`)
	for _, q := range []string{`
INSERT INTO ` + s + `.arrivals (id, message_id, exchange, routing_key, arrived_at, headers, body, body_size)
SELECT 'arr-' || g, 'big-' || g, 'orders', 'order.created', now() - g * interval '1 ms', '{"tenant":"acme"}', b.body, $1
FROM generate_series(1, $2) g, (SELECT convert_to(repeat('x', $1), 'UTF8') AS body) b`, `
INSERT INTO ` + s + `.messages (message_id, first_arrival_at)
SELECT 'big-' || g, now() - g * interval '1 ms' FROM generate_series(1, $2) g WHERE $1 > 0`} {
		if _, err := st.Pool().Exec(ctx, q, bodySize, n); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d messages of %d KiB written in %v", n, bodySize>>10, time.Since(start).Round(time.Millisecond))
	srv := serve(t, httpapi.Config{Store: st})

	runtime.GC()
	base := heapBytes()
	var peak atomic.Uint64
	done := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			if h := heapBytes(); h > peak.Load() {
				peak.Store(h)
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	resp, err := http.Get(srv.URL + "/v1/messages?limit=" + strconv.Itoa(n))
	if err != nil {
		t.Fatal(err)
	}
	var page auditparse.SearchResponse
	err = json.NewDecoder(resp.Body).Decode(&page)
	resp.Body.Close()
	close(done)
	<-sampled
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET: %d %v", resp.StatusCode, err)
	}
	withBody := 0
	for _, m := range page.Messages {
		if m.Arrival == nil || m.Arrival.BodySize != bodySize {
			t.Fatalf("message %s: arrival %+v", m.MessageID, m.Arrival)
		}
		if m.Arrival.Body != nil {
			withBody++
		}
	}
	grew := int64(peak.Load()) - int64(base)
	t.Logf("%d messages listed, %d with a body; peak heap %.1f MiB above the %.1f MiB before (%.0f bytes per message)",
		len(page.Messages), withBody, float64(grew)/(1<<20), float64(base)/(1<<20), float64(grew)/float64(n))
	if len(page.Messages) != n || withBody != 0 || page.Next == "" {
		t.Errorf("listed %d (want %d), %d with a body (want 0), next %q (want a cursor)", len(page.Messages), n, withBody, page.Next)
	}
	if grew > 100<<20 {
		t.Errorf("peak heap grew %.1f MiB, want under 100 MiB", float64(grew)/(1<<20))
	}
	// Show still has the body.
	m, ok, err := st.Get(ctx, "big-1")
	if err != nil || !ok || len(m.Arrival.Body) != bodySize {
		t.Errorf("Get big-1: %v %v, body %d bytes", ok, err, len(m.Arrival.Body))
	}
}

// heapBytes is the live and not yet swept heap objects (runtime/metrics,
// no stop-the-world).
func heapBytes() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
