package httpapi_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/httpapi"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
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
		EnableResend: true, ResendToken: token, Resender: rs})
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
	srv := serve(t, httpapi.Config{Store: st, EnableResend: true, ResendToken: token, Resender: rs})
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
