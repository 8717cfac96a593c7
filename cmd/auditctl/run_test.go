package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/auditparse"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// runCtl runs auditctl with args and returns exit code, stdout, stderr.
func runCtl(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := runContext(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestUsageErrors(t *testing.T) {
	t.Setenv(tokenEnv, "")
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"search", "extra"},
		{"search", "--from", "yesterday"},
		{"search", "--from", "2026-11-24T10:00:00Z", "--to", "2026-11-24T09:00:00Z"},
		{"search", "--outcome", "exploded"},
		{"search", "--last-outcome", "nope"},
		{"search", "--header", "novalue"},
		{"search", "--limit", "-1"},
		{"search", "--limit", "10001"},
		{"search", "--no-such-flag"},
		{"show"},
		{"show", "a", "b"},
		{"resend", "--message-id", "m"},
		{"resend", "--message-id", "m", "--to-queue", "--to-exchange"},
		{"resend", "--message-id", "m", "--to-exchange", "--target-queue", "q"},
		{"prune"},
		{"prune", "--older-than", "-1h"},
		{"prune", "--older-than", "1h", "--batch", "0"},
		{"serve", "--enable-resend"},
	} {
		code, out, errOut := runCtl(t, append([]string{"--dsn", "postgres://nobody@127.0.0.1:1/x"}, args...)...)
		if code != exitUsage || out != "" || errOut == "" {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want exit 2, a message, no output", args, code, out, errOut)
		}
	}
	for _, args := range [][]string{{"-h"}, {"help"}, {"search", "-h"}, {"resend", "-h"}} {
		if code, _, errOut := runCtl(t, args...); code != exitOK || !strings.Contains(errOut, "Usage") {
			t.Errorf("%q: exit %d %q", args, code, errOut)
		}
	}
	// A database that cannot be reached is an operation failure.
	if code, _, errOut := runCtl(t, "--dsn", "postgres://nobody@127.0.0.1:1/x", "stats"); code != exitFail || errOut == "" {
		t.Errorf("unreachable database: exit %d %q", code, errOut)
	}
}

func TestParseWhen(t *testing.T) {
	now := time.Date(2026, 11, 24, 9, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"-1h":                       now.Add(-time.Hour),
		"90m":                       now.Add(-90 * time.Minute),
		"2026-11-24T08:00:00+01:00": time.Date(2026, 11, 24, 7, 0, 0, 0, time.UTC),
	} {
		got, err := parseWhen("from", in, now)
		if err != nil || !got.Equal(want) {
			t.Errorf("%s: %v %v, want %v", in, got, err, want)
		}
	}
}

// fixture: a migrated schema of its own (through auditctl migrate) with
// 10 messages: m-00..m-09, tenant acme for the even ones, arrived 2 h ago
// for m-00..m-03 (prune fodder), else 10 min ago; one attempt each in
// queue q1, poisoned (odd) or successful (even).
type fixture struct {
	dsn, schema string
	st          *pgstore.Store
	base        []string // global flags
	arrivals    []audit.Arrival
}

func newFixture(t *testing.T, exchange, key, queue string) *fixture {
	t.Helper()
	dsn := testkit.HavePG(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	fx := &fixture{dsn: dsn, schema: "rrctl_" + hex.EncodeToString(b[:])}
	fx.base = []string{"--dsn", dsn, "--schema", fx.schema}
	// Before migrate: an operation failure that says what to do.
	if code, _, errOut := runCtl(t, append(fx.base, "stats")...); code != exitFail || !strings.Contains(errOut, "auditctl migrate") {
		t.Fatalf("stats before migrate: %d %q", code, errOut)
	}
	code, out, errOut := runCtl(t, append(fx.base, "migrate", "--json")...)
	if code != exitOK {
		t.Fatalf("migrate: %d %s %s", code, out, errOut)
	}
	var mig struct {
		Applied []int
		Version int
	}
	if err := json.Unmarshal([]byte(out), &mig); err != nil || len(mig.Applied) == 0 || mig.Version != mig.Applied[len(mig.Applied)-1] {
		t.Fatalf("migrate --json: %s %v", out, err)
	}
	st, err := pgstore.New(context.Background(), pgstore.Config{DSN: dsn, Schema: fx.schema, SkipMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	fx.st = st
	t.Cleanup(func() {
		_, _ = st.Pool().Exec(context.Background(), `DROP SCHEMA IF EXISTS `+fx.schema+` CASCADE`)
		st.Close()
	})
	if code, out, _ := runCtl(t, append(fx.base, "migrate")...); code != exitOK || !strings.Contains(out, "up to date") {
		t.Fatalf("second migrate: %d %s", code, out)
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	var attempts []audit.Attempt
	for i := range 10 {
		id := fmt.Sprintf("m-%02d", i)
		tenant := "globex"
		if i%2 == 0 {
			tenant = "acme"
		}
		at := now.Add(-10*time.Minute + time.Duration(i)*time.Second)
		if i < 4 {
			at = now.Add(-2*time.Hour + time.Duration(i)*time.Second)
		}
		body := fmt.Sprintf(`{"order":%d}`, i)
		fx.arrivals = append(fx.arrivals, audit.Arrival{ID: "arr-" + id, MessageID: id, Exchange: exchange, RoutingKey: key,
			ArrivedAt: at, Headers: map[string]any{"tenant": tenant, "_watermill_message_uuid": id, "n": i},
			Properties: map[string]string{"content-type": "application/json"}, Body: []byte(body), BodySize: len(body)})
		o, class, errText := audit.OutcomeSuccess, "", ""
		if i%2 == 1 {
			o, class, errText = audit.OutcomePoisoned, "permanent", "order rejected: missing SKU"
		}
		attempts = append(attempts, audit.Attempt{ID: "att-" + id, MessageID: id, Queue: queue, Attempt: 1, StartedAt: at,
			Duration: 3 * time.Millisecond, Outcome: o, ErrorClass: class, Error: errText})
	}
	if err := st.Write(context.Background(), fx.arrivals, attempts); err != nil {
		t.Fatal(err)
	}
	return fx
}

func (fx *fixture) run(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	return runCtl(t, append(append([]string{}, fx.base...), args...)...)
}

func TestSearchShowStatsPrune(t *testing.T) {
	fx := newFixture(t, "orders", "order.created", "billing")

	// Paging by header, in JSON.
	var ids []string
	after := ""
	for pages := 0; ; pages++ {
		args := []string{"search", "--json", "--header", "tenant=acme", "--limit", "2"}
		if after != "" {
			args = append(args, "--after", after)
		}
		code, out, errOut := fx.run(t, args...)
		if code != exitOK {
			t.Fatalf("search: %d %s", code, errOut)
		}
		var resp auditparse.SearchResponse
		if err := json.Unmarshal([]byte(out), &resp); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		for _, m := range resp.Messages {
			ids = append(ids, m.MessageID)
		}
		if resp.Next == "" || pages > 5 {
			break
		}
		after = resp.Next
	}
	if strings.Join(ids, ",") != "m-08,m-06,m-04,m-02,m-00" {
		t.Fatalf("acme pages: %v, want the 5 even ones newest first, each once", ids)
	}

	// Table, several filters at once (header with a JSON number).
	code, out, errOut := fx.run(t, "search", "--queue", "billing", "--outcome", "poisoned", "--class", "permanent",
		"--error-contains", "MISSING sku", "--from", "1h", "--exchange", "orders", "--routing-key", "order.created", "--header", "n=5")
	if code != exitOK || !strings.Contains(out, "m-05") || strings.Count(out, "\n") != 2 || !strings.Contains(errOut, "1 message(s)") {
		t.Fatalf("filtered search: %d\n%s%s", code, out, errOut)
	}
	if code, out, _ := fx.run(t, "search", "--last-outcome", "success", "--to", "1h"); code != exitOK ||
		!strings.Contains(out, "m-02") || !strings.Contains(out, "m-00") || strings.Contains(out, "m-01") || strings.Contains(out, "m-04") {
		t.Fatalf("last-outcome/to: %s", out)
	}

	// show: the full story, text and JSON; unknown id fails.
	code, out, _ = fx.run(t, "show", "m-05")
	for _, want := range []string{"Message m-05", "Exchange:", "orders", `"globex"`, `{"order":5}`, "tenant", "poisoned", "missing SKU", "billing"} {
		if code != exitOK || !strings.Contains(out, want) {
			t.Fatalf("show lacks %q (exit %d):\n%s", want, code, out)
		}
	}
	code, out, _ = fx.run(t, "show", "m-05", "--json")
	var m audit.Message
	if err := json.Unmarshal([]byte(out), &m); code != exitOK || err != nil || string(m.Arrival.Body) != `{"order":5}` || len(m.Attempts) != 1 {
		t.Fatalf("show --json: %d %s", code, out)
	}
	if code, _, errOut := fx.run(t, "show", "nope"); code != exitFail || !strings.Contains(errOut, "nope") {
		t.Fatalf("show unknown: %d %s", code, errOut)
	}

	// stats, then prune the four old ones, then stats again.
	stats := func() statsJSON {
		code, out, errOut := fx.run(t, "stats", "--json")
		var s statsJSON
		if err := json.Unmarshal([]byte(out), &s); code != exitOK || err != nil {
			t.Fatalf("stats: %d %s %s", code, out, errOut)
		}
		return s
	}
	if s := stats(); s.Arrivals != 10 || s.Attempts != 10 || s.Messages != 10 || s.Schema != fx.schema {
		t.Fatalf("stats before prune: %+v", s)
	}
	code, out, _ = fx.run(t, "prune", "--older-than", "1h", "--batch", "3", "--json")
	var pr struct{ Arrivals, Attempts, Statements int }
	if err := json.Unmarshal([]byte(out), &pr); code != exitOK || err != nil || pr.Arrivals != 4 || pr.Attempts != 4 {
		t.Fatalf("prune: %d %s", code, out)
	}
	if s := stats(); s.Arrivals != 6 || s.Attempts != 6 {
		t.Fatalf("stats after prune: %+v", s)
	}
	t.Logf("accounting: stored 10, pruned 4 older than 1h (%d statements of <= 3 rows), left 6", pr.Statements)
}

// brokerTopology: exchange ex with queues q1 and q2 bound with key, both
// bound to a loop-back exchange under their own names.
type brokerTopology struct {
	ch                        *amqp.Channel
	loopBack, ex, key, q1, q2 string
}

func newBrokerTopology(t *testing.T) *brokerTopology {
	t.Helper()
	conn, err := amqp.Dial(testkit.URI(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	tp := &brokerTopology{ch: ch, loopBack: testkit.UniqueName(t, "lb"), ex: testkit.UniqueName(t, "orders"),
		key: "order.created", q1: testkit.UniqueName(t, "billing"), q2: testkit.UniqueName(t, "shipping")}
	for _, ex := range []string{tp.loopBack, tp.ex} {
		if err := ch.ExchangeDeclare(ex, "direct", false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, q := range []string{tp.q1, tp.q2} {
		if _, err := ch.QueueDeclare(q, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(q, tp.key, tp.ex, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(q, q, tp.loopBack, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if c, err := conn.Channel(); err == nil {
			_, _ = c.QueueDelete(tp.q1, false, false, false)
			_, _ = c.QueueDelete(tp.q2, false, false, false)
			_ = c.ExchangeDelete(tp.loopBack, false, false)
			_ = c.ExchangeDelete(tp.ex, false, false)
		}
	})
	return tp
}

// drain returns the ids (UUID header) of the messages in q, waiting for
// want of them, and checks none more is there.
func (tp *brokerTopology) drain(t *testing.T, q string, want int) []string {
	t.Helper()
	var ids []string
	testkit.WaitFor(t, 10*time.Second, fmt.Sprintf("%d messages in %s", want, q), func() bool {
		for {
			d, ok, err := tp.ch.Get(q, true)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				return len(ids) >= want
			}
			id, _ := d.Headers["_watermill_message_uuid"].(string)
			ids = append(ids, id)
		}
	})
	if qi, err := tp.ch.QueueDeclarePassive(q, false, false, false, false, nil); err != nil || len(ids) != want || qi.Messages != 0 {
		t.Fatalf("%s: got %v (+%d left, %v), want %d", q, ids, qi.Messages, err, want)
	}
	return ids
}

func TestResend(t *testing.T) {
	tp := newBrokerTopology(t)
	fx := newFixture(t, tp.ex, tp.key, tp.q1)
	fx.base = append(fx.base, "--uri", testkit.URI(t))
	t.Setenv(mgmtEnv, testkit.MgmtURI()) // a to-exchange resend reads the bindings of the broker under test
	lb := "--loop-back-exchange=" + tp.loopBack

	// Several messages without --yes: refused (exit 2), shown, nothing sent.
	code, out, errOut := fx.run(t, "resend", "--to-queue", lb, "--header", "tenant=acme")
	if code != exitUsage || !strings.Contains(errOut, "--yes") || strings.Count(out, "would-send") != 5 {
		t.Fatalf("without --yes: %d\n%s%s", code, out, errOut)
	}
	// Dry run: the report, nothing sent.
	code, out, errOut = fx.run(t, "resend", "--to-queue", lb, "--header", "tenant=acme", "--dry-run", "--json")
	var rep audit.ResendReport
	if err := json.Unmarshal([]byte(out), &rep); code != exitOK || err != nil || rep.Matched != 5 || rep.Sent != 5 || !rep.DryRun {
		t.Fatalf("dry run: %d %s %s", code, out, errOut)
	}
	// The empty filter is refused without --all.
	if code, _, errOut := fx.run(t, "resend", "--to-exchange", "--yes"); code != exitUsage || !strings.Contains(errOut, "--all") {
		t.Fatalf("empty filter: %d %s", code, errOut)
	}
	tp.drain(t, tp.q1, 0)
	tp.drain(t, tp.q2, 0)

	// With --yes: exactly the acme messages, to q1 only.
	code, out, errOut = fx.run(t, "resend", "--to-queue", lb, "--header", "tenant=acme", "--yes")
	if code != exitOK || strings.Count(out, " sent ") != 5 || !strings.Contains(errOut, "matched 5, sent 5, failed 0, skipped 0") {
		t.Fatalf("--yes: %d\n%s%s", code, out, errOut)
	}
	got := tp.drain(t, tp.q1, 5)
	tp.drain(t, tp.q2, 0)
	for _, id := range got {
		var n int
		if _, err := fmt.Sscanf(id, "m-%d", &n); err != nil || n%2 != 0 {
			t.Fatalf("received %q, not an acme message", id)
		}
	}
	t.Logf("accounting: stored 10, acme 5: matched 5, sent 5, received in %s 5, %s 0, globex untouched 5", tp.q1, tp.q2)

	// One message needs no --yes; to the exchange, every bound queue (the
	// exchange's bindings read from the management API first).
	if testkit.MgmtURI() != "" {
		code, out, errOut = fx.run(t, "resend", "--to-exchange", "--message-id", "m-03")
		if code != exitOK {
			t.Fatalf("single to-exchange: %d %s %s", code, out, errOut)
		}
		if a, b := tp.drain(t, tp.q1, 1), tp.drain(t, tp.q2, 1); a[0] != "m-03" || b[0] != "m-03" {
			t.Fatalf("got %v %v", a, b)
		}
	}

	// A target queue not bound to the loop-back exchange: returned, exit 1.
	code, out, errOut = fx.run(t, "resend", "--to-queue", lb, "--message-id", "m-03", "--target-queue", "nobody-"+tp.q1, "--json")
	if err := json.Unmarshal([]byte(out), &rep); code != exitFail || err != nil || rep.Failed != 1 || !strings.Contains(rep.Results[0].Error, "unroutable") {
		t.Fatalf("unroutable: %d %s %s", code, out, errOut)
	}
	// A missing loop-back exchange: exit 1, nothing sent.
	if code, _, errOut := fx.run(t, "resend", "--to-queue", "--loop-back-exchange", "nope-"+tp.loopBack, "--message-id", "m-03"); code != exitFail || !strings.Contains(errOut, "not found") {
		t.Fatalf("missing loop-back: %d %s", code, errOut)
	}
	tp.drain(t, tp.q1, 0)
	tp.drain(t, tp.q2, 0)
}

// startServe runs auditctl serve on a free port; stop cancels it and
// checks it exited 0.
func startServe(t *testing.T, global []string, serveFlags ...string) (base string, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var stderr testkit.SyncBuffer
	done := make(chan int, 1)
	go func() {
		args := append(append(append([]string{}, global...), "serve", "--listen", "127.0.0.1:0"), serveFlags...)
		done <- runContext(ctx, args, io.Discard, &stderr)
	}()
	re := regexp.MustCompile(`serving (http://[0-9.:]+)`)
	testkit.WaitFor(t, 10*time.Second, "serve to listen", func() bool {
		select {
		case code := <-done:
			t.Fatalf("serve exited %d: %s", code, stderr.String())
		default:
		}
		return re.MatchString(stderr.String())
	})
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if code := testkit.Recv(t, done, 10*time.Second); code != exitOK {
				t.Errorf("serve exit %d: %s", code, stderr.String())
			}
		})
	}
	t.Cleanup(stop)
	return re.FindStringSubmatch(stderr.String())[1], stop
}

func httpDo(t *testing.T, method, url, auth, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	if auth != "" {
		req.Header.Set("Authorization", "Bearer "+auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestServe(t *testing.T) {
	fx := newFixture(t, "orders", "order.created", "billing")
	t.Setenv(readTokenEnv, "")
	t.Setenv(tokenEnv, "")
	base, stop := startServe(t, fx.base)
	code, body := httpDo(t, "GET", base+"/v1/messages?header=tenant=acme&limit=3", "", "")
	var sr auditparse.SearchResponse
	if err := json.Unmarshal([]byte(body), &sr); code != 200 || err != nil || len(sr.Messages) != 3 || sr.Next == "" {
		t.Fatalf("search: %d %s", code, body)
	}
	if code, body := httpDo(t, "GET", base+"/v1/messages/m-03", "", ""); code != 200 || !strings.Contains(body, `"message_id": "m-03"`) {
		t.Fatalf("get: %d %s", code, body)
	}
	if code, body := httpDo(t, "GET", base+"/v1/stats", "", ""); code != 200 || !strings.Contains(body, `"arrivals": 10`) {
		t.Fatalf("stats: %d %s", code, body)
	}
	if code, _ := httpDo(t, "POST", base+"/v1/resend", "", `{"filter":{"message_id":"m-01"},"mode":"to-queue"}`); code != 404 {
		t.Fatalf("resend on a read-only server: %d, want 404", code)
	}
	stop()
}

func TestServeWithTokens(t *testing.T) {
	fx := newFixture(t, "orders", "order.created", "billing")
	const readTok, resendTok = "read-token-abcdefghijkl", "resend-token-abcdefghijkl"
	t.Setenv(readTokenEnv, readTok)
	t.Setenv(tokenEnv, resendTok)
	global := append(append([]string{}, fx.base...), "--uri", "amqp://guest:guest@127.0.0.1:1/")
	base, stop := startServe(t, global)
	if code, _ := httpDo(t, "GET", base+"/v1/messages?queue=billing", "", ""); code != 401 {
		t.Fatalf("read without token: %d", code)
	}
	if code, _ := httpDo(t, "GET", base+"/v1/messages?queue=billing", readTok, ""); code != 200 {
		t.Fatalf("read with token: %d", code)
	}
	// Not enabled: 404 even with the right token.
	req := `{"filter":{"message_id":"m-05"},"mode":"to-queue","dry_run":true}`
	if code, _ := httpDo(t, "POST", base+"/v1/resend", resendTok, req); code != 404 {
		t.Fatalf("resend not enabled: %d", code)
	}
	stop()
	base, _ = startServe(t, global, "--enable-resend")
	if code, _ := httpDo(t, "POST", base+"/v1/resend", readTok, req); code != 403 {
		t.Fatalf("resend with the read token: %d", code)
	}
	code, body := httpDo(t, "POST", base+"/v1/resend", resendTok, req)
	var rep audit.ResendReport
	if err := json.Unmarshal([]byte(body), &rep); code != 200 || err != nil || rep.Sent != 1 || rep.Results[0].Queue != "billing" || !rep.DryRun {
		t.Fatalf("dry-run resend: %d %s", code, body)
	}
}

// TestStatsShowsSetAside: records the store rejected for good are counted
// by auditctl stats, the latest with their reasons (text and JSON).
func TestStatsShowsSetAside(t *testing.T) {
	fx := newFixture(t, "orders", "order.created", "billing")
	rec := audit.SetAside{Kind: auditconst.KindArrival, RecordID: "r-1", MessageID: strings.Repeat("m", 8000),
		Reason: "pgstore: arrivals[0].MessageID is 8000 bytes, more than 1024 (MaxIndexedBytes)", Record: []byte(`{}`)}
	if err := fx.st.SetAside(context.Background(), []audit.SetAside{rec}); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := fx.run(t, "stats", "--json")
	var s statsJSON
	if err := json.Unmarshal([]byte(out), &s); code != exitOK || err != nil || s.SetAside != 1 || len(s.SetAsideRecent) != 1 ||
		s.SetAsideRecent[0].Reason != rec.Reason {
		t.Fatalf("stats --json: %d %s %s", code, out, errOut)
	}
	code, out, errOut = fx.run(t, "stats")
	if code != exitOK || !strings.Contains(out, "Set aside:") || !strings.Contains(out, "MessageID is 8000 bytes") {
		t.Fatalf("stats: %d %s %s", code, out, errOut)
	}
}
