package httpapi_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/httpapi"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/auditparse"
)

const token = "s3cret-token-0123456789"

// fakeStore records the filters it was asked for and answers with msgs.
type fakeStore struct {
	mu      sync.Mutex
	filters []audit.Filter
	msgs    []audit.Message
	next    string
	err     error
}

func (s *fakeStore) Write(context.Context, []audit.Arrival, []audit.Attempt) error { return nil }

func (s *fakeStore) Search(ctx context.Context, f audit.Filter) ([]audit.Message, error) {
	m, _, err := s.SearchPage(ctx, f)
	return m, err
}

func (s *fakeStore) SearchPage(_ context.Context, f audit.Filter) ([]audit.Message, string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.filters = append(s.filters, f)
	if f.After != "" && f.After == s.next {
		return nil, "", s.err // the page after the last
	}
	var out []audit.Message
	for _, m := range s.msgs {
		if f.MessageID == "" || m.MessageID == f.MessageID {
			out = append(out, m)
		}
	}
	return out, s.next, s.err
}

func (s *fakeStore) Get(_ context.Context, id string) (audit.Message, bool, error) {
	for _, m := range s.msgs {
		if m.MessageID == id {
			return m, true, nil
		}
	}
	return audit.Message{}, false, s.err
}

func (s *fakeStore) lastFilter(t *testing.T) audit.Filter {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.filters) == 0 {
		t.Fatal("the store was not searched")
	}
	return s.filters[len(s.filters)-1]
}

func sampleStore() *fakeStore {
	body := []byte{0, 1, 2, 'h', 'i', 0xff}
	return &fakeStore{next: "cursor-2", msgs: []audit.Message{{
		MessageID: "m-1",
		Arrival: &audit.Arrival{ID: "arr-1", MessageID: "m-1", Exchange: "orders", RoutingKey: "order.created",
			ArrivedAt: time.Date(2026, 11, 24, 9, 0, 0, 0, time.UTC), Headers: map[string]any{"tenant": "acme"},
			Body: body, BodySize: len(body)},
		Attempts: []audit.Attempt{{ID: "a1", MessageID: "m-1", Queue: "billing", Attempt: 1, Outcome: audit.OutcomePoisoned, ErrorClass: "permanent"}},
	}}}
}

// fakeResender records calls.
type fakeResender struct {
	mu    sync.Mutex
	calls []audit.ResendOptions
}

func (r *fakeResender) Resend(_ context.Context, f audit.Filter, o audit.ResendOptions) (audit.ResendReport, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, o)
	return audit.ResendReport{Mode: o.Mode, DryRun: o.DryRun, Matched: 1, Sent: 1,
		Results: []audit.ResendResult{{MessageID: f.MessageID, Status: auditconst.StatusSent}}}, nil
}

func serve(t *testing.T, cfg httpapi.Config) *httptest.Server {
	t.Helper()
	h, err := httpapi.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func do(t *testing.T, method, u, auth, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, u, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s %s: Content-Type %q", method, u, ct)
	}
	return resp.StatusCode, b
}

func TestSearchParsesEveryFilterParameter(t *testing.T) {
	st := sampleStore()
	srv := serve(t, httpapi.Config{Store: st})
	q := url.Values{
		"message_id": {"m-1"}, "correlation_id": {"c-1"},
		"from": {"2026-11-24T08:00:00Z"}, "to": {"2026-11-24T10:00:00.5+01:00"},
		"queue": {"billing"}, "exchange": {"orders"}, "routing_key": {"order.created"},
		"outcome": {"retry"}, "last_outcome": {"poisoned"}, "error_class": {"permanent"},
		"error_contains": {"Timeout"}, "header": {"tenant=acme", "priority=5", "flag=true", `quoted="7"`, "eq=a=b"},
		"limit": {"25"}, "after": {"cursor-1"},
	}
	code, body := do(t, "GET", srv.URL+"/v1/messages?"+q.Encode(), "", "")
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	want := audit.Filter{
		MessageID: "m-1", CorrelationID: "c-1",
		From: time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC), To: time.Date(2026, 11, 24, 9, 0, 0, 5e8, time.UTC),
		Queue: "billing", Exchange: "orders", RoutingKey: "order.created",
		Outcome: audit.OutcomeRetry, LastOutcome: audit.OutcomePoisoned, ErrorClass: "permanent", ErrorContains: "Timeout",
		Headers: map[string]any{"tenant": "acme", "priority": float64(5), "flag": true, "quoted": "7", "eq": "a=b"},
		Limit:   25, After: "cursor-1",
	}
	got := st.lastFilter(t)
	if !got.From.Equal(want.From) || !got.To.Equal(want.To) {
		t.Fatalf("from/to %v %v", got.From, got.To)
	}
	got.From, got.To, want.From, want.To = time.Time{}, time.Time{}, time.Time{}, time.Time{}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("filter\n got %#v\nwant %#v", got, want)
	}
	var resp auditparse.SearchResponse
	if err := json.Unmarshal(body, &resp); err != nil {
		t.Fatal(err)
	}
	// Search results carry no bodies (issue 19 item 12); show does, base64.
	if resp.Next != "cursor-2" || len(resp.Messages) != 1 || resp.Messages[0].Arrival.Body != nil || resp.Messages[0].Arrival.BodySize != 6 {
		t.Fatalf("response %s", body)
	}
	code, body = do(t, "GET", srv.URL+"/v1/messages/m-1", "", "")
	if code != 200 || !strings.Contains(string(body), `"body": "AAECaGn/"`) {
		t.Errorf("show: body not base64 in JSON: %d %s", code, body)
	}
	if b := st.msgs[0].Arrival.Body; string(b) != "\x00\x01\x02hi\xff" {
		t.Errorf("the store's message was changed: %q", b)
	}
}

func TestSearchRejectsBadParameters(t *testing.T) {
	st := sampleStore()
	srv := serve(t, httpapi.Config{Store: st})
	for q, want := range map[string]string{
		"tennant=acme":            `unknown parameter \"tennant\"`,
		"limit=0":                 "limit",
		"limit=10001":             "limit",
		"limit=ten":               "limit",
		"from=yesterday":          "from",
		"to=2026-13-01T00:00:00Z": "to",
		"outcome=exploded":        "outcome",
		"last_outcome=nope":       "last_outcome",
		"header=novalue":          "header",
		"header==x":               "header",
		"queue=a&queue=b":         "queue",
		"from=2026-11-24T10:00:00Z&to=2026-11-24T09:00:00Z": "before",
	} {
		code, body := do(t, "GET", srv.URL+"/v1/messages?"+q, "", "")
		var e struct{ Error string }
		_ = json.Unmarshal(body, &e)
		if code != 400 || !strings.Contains(string(body), want) || e.Error == "" {
			t.Errorf("%s: %d %s, want 400 naming %s", q, code, body, want)
		}
	}
	if len(st.filters) != 0 {
		t.Fatalf("the store was searched for bad input: %+v", st.filters)
	}
	st.err = errors.New("database down")
	if code, body := do(t, "GET", srv.URL+"/v1/messages?queue=q", "", ""); code != 500 || strings.Contains(string(body), "database down") {
		t.Errorf("store error: %d %s, want 500 without the store's text (it goes to the log only)", code, body)
	}
}

func TestGetAndStats(t *testing.T) {
	srv := serve(t, httpapi.Config{Store: sampleStore()})
	code, body := do(t, "GET", srv.URL+"/v1/messages/m-1", "", "")
	var m audit.Message
	if err := json.Unmarshal(body, &m); code != 200 || err != nil || m.Arrival == nil || len(m.Attempts) != 1 || m.Attempts[0].Queue != "billing" {
		t.Fatalf("%d %s", code, body)
	}
	if code, body := do(t, "GET", srv.URL+"/v1/messages/nope", "", ""); code != 404 || !strings.Contains(string(body), "nope") {
		t.Fatalf("unknown id: %d %s", code, body)
	}
	if code, _ := do(t, "GET", srv.URL+"/v1/stats", "", ""); code != 404 {
		t.Fatalf("stats without Config.Stats: %d", code)
	}
	srv = serve(t, httpapi.Config{Store: sampleStore(), Stats: func(context.Context) (any, error) {
		return map[string]int{"arrivals": 3}, nil
	}})
	if code, body := do(t, "GET", srv.URL+"/v1/stats", "", ""); code != 200 || !strings.Contains(string(body), `"arrivals": 3`) {
		t.Fatalf("stats: %d %s", code, body)
	}
}

func TestResendIsOffByDefaultAndNeedsTheToken(t *testing.T) {
	req := `{"filter":{"message_id":"m-1"},"mode":"to-queue"}`
	rs := &fakeResender{}
	// Read-only by default: the route does not exist.
	srv := serve(t, httpapi.Config{Store: sampleStore(), Resend: rs.Resend, ResendToken: token})
	if code, _ := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, req); code != 404 {
		t.Fatalf("resend not enabled: %d, want 404", code)
	}
	srv = serve(t, httpapi.Config{Store: sampleStore(), Resend: rs.Resend, EnableResend: true, ResendToken: token})
	for auth, want := range map[string]int{
		"":                      401,
		"Basic Zm9vOmJhcg==":    401,
		"Bearer ":               401,
		"Bearer wrong":          403,
		"Bearer " + token + "x": 403,
		"Bearer " + token[:10]:  403,
	} {
		if code, body := do(t, "POST", srv.URL+"/v1/resend", auth, req); code != want {
			t.Errorf("Authorization %q: %d %s, want %d", auth, code, body, want)
		}
	}
	if len(rs.calls) != 0 {
		t.Fatalf("unauthorised requests reached the resender: %+v", rs.calls)
	}
	code, body := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, req)
	var rep audit.ResendReport
	if err := json.Unmarshal(body, &rep); code != 200 || err != nil || rep.Sent != 1 || rep.Results[0].MessageID != "m-1" {
		t.Fatalf("authorised: %d %s", code, body)
	}
	if len(rs.calls) != 1 || rs.calls[0].Mode != audit.ResendToQueue {
		t.Fatalf("calls %+v", rs.calls)
	}
	// GET on the resend route is not a resend.
	if code, _ := do(t, "GET", srv.URL+"/v1/resend", "Bearer "+token, ""); code == 200 {
		t.Fatalf("GET /v1/resend answered 200")
	}
}

func TestResendValidatesTheRequest(t *testing.T) {
	rs := &fakeResender{}
	srv := serve(t, httpapi.Config{Store: sampleStore(), Resend: rs.Resend, EnableResend: true, ResendToken: token})
	for body, want := range map[string]string{
		`{"filter":{},"mode":"to-queue"}`:                                "every message",
		`{"filter":{"limit":5},"mode":"to-exchange"}`:                    "every message",
		`{"filter":{"message_id":"m"},"mode":"sideways"}`:                "Mode",
		`{"filter":{"message_id":"m"}}`:                                  "Mode",
		`{"filter":{"message_id":"m"},"mode":"to-exchange","queue":"q"}`: "Queue",
		`{"filter":{"message_id":"m"},"mode":"to-queue","dryrun":true}`:  "unknown field",
		`{"filter":{"message_id":"m","outcome":"x"},"mode":"to-queue"}`:  "outcome",
		`{"filter":{"message_id":"m"},"mode":"to-queue"} {}`:             "more than one",
		`not json`: "request body",
	} {
		code, b := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, body)
		if code != 400 || !strings.Contains(string(b), want) {
			t.Errorf("%s: %d %s, want 400 with %q", body, code, b, want)
		}
	}
	if len(rs.calls) != 0 {
		t.Fatalf("bad requests reached the resender: %+v", rs.calls)
	}
	// allow_all lets an empty filter through, explicitly.
	if code, b := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, `{"filter":{},"mode":"to-queue","allow_all":true,"dry_run":true}`); code != 200 {
		t.Fatalf("allow_all: %d %s", code, b)
	}
}

// The real Resender behind the API, in dry run (no broker needed): the
// report says what would be sent where.
func TestResendDryRunThroughRealResender(t *testing.T) {
	st := sampleStore()
	r, err := audit.NewResender(audit.ResenderConfig{URI: "amqp://guest:guest@127.0.0.1:1/", Store: st})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	srv := serve(t, httpapi.Config{Store: st, Resend: r.Resend, EnableResend: true, ResendToken: token})
	code, b := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, `{"filter":{"message_id":"m-1"},"mode":"to-queue","dry_run":true}`)
	var rep audit.ResendReport
	if err := json.Unmarshal(b, &rep); code != 200 || err != nil {
		t.Fatalf("%d %s", code, b)
	}
	if rep.Matched != 1 || rep.Sent != 1 || rep.Results[0].Status != auditconst.StatusWouldSend ||
		rep.Results[0].Queue != "billing" || rep.Results[0].Exchange != auditconst.LoopBackExchange {
		t.Fatalf("report %s", b)
	}
}

func TestConfigValidate(t *testing.T) {
	st := sampleStore()
	for _, c := range []struct {
		cfg  httpapi.Config
		want string
	}{
		{httpapi.Config{}, "Store"},
		{httpapi.Config{Store: st, EnableResend: true, Resend: (&fakeResender{}).Resend}, "ResendToken"},
		{httpapi.Config{Store: st, EnableResend: true, Resend: (&fakeResender{}).Resend, ResendToken: "short"}, "ResendToken"},
		{httpapi.Config{Store: st, EnableResend: true, ResendToken: token}, "Resend"},
		{httpapi.Config{Store: st, ResendTimeout: -time.Second}, "ResendTimeout"},
	} {
		if _, err := httpapi.New(c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %s", c.cfg, err, c.want)
		}
	}
}

func TestReadToken(t *testing.T) {
	const readToken = "reader-token-0123456789"
	srv := serve(t, httpapi.Config{Store: sampleStore(), ReadToken: readToken, EnableResend: true, ResendToken: token, Resend: (&fakeResender{}).Resend,
		Stats: func(context.Context) (any, error) { return map[string]int{}, nil }})
	for _, path := range []string{"/v1/messages?queue=billing", "/v1/messages/m-1", "/v1/stats"} {
		for auth, want := range map[string]int{"": 401, "Bearer nope": 403, "Bearer " + readToken: 200, "Bearer " + token: 200} {
			if code, body := do(t, "GET", srv.URL+path, auth, ""); code != want {
				t.Errorf("GET %s with %q: %d %s, want %d", path, auth, code, body, want)
			}
		}
	}
	// The read token does not allow resends.
	if code, _ := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+readToken, `{"filter":{"message_id":"m-1"},"mode":"to-queue"}`); code != 403 {
		t.Errorf("resend with the read token: %d, want 403", code)
	}
	if _, err := httpapi.New(httpapi.Config{Store: sampleStore(), ReadToken: "short"}); err == nil || !strings.Contains(err.Error(), "ReadToken") {
		t.Errorf("short ReadToken: %v", err)
	}
}

// blockingResender holds every Resend until release is closed.
type blockingResender struct {
	started chan struct{}
	release chan struct{}
}

func (b *blockingResender) Resend(_ context.Context, _ audit.Filter, o audit.ResendOptions) (audit.ResendReport, error) {
	b.started <- struct{}{}
	<-b.release
	return audit.ResendReport{Mode: o.Mode}, nil
}

func TestOneResendAtATime(t *testing.T) {
	b := &blockingResender{started: make(chan struct{}, 2), release: make(chan struct{})}
	srv := serve(t, httpapi.Config{Store: sampleStore(), Resend: b.Resend, EnableResend: true, ResendToken: token})
	req := `{"filter":{"message_id":"m-1"},"mode":"to-queue"}`
	first := make(chan int, 1)
	go func() { // no t.Fatal off the test goroutine
		r, _ := http.NewRequest("POST", srv.URL+"/v1/resend", strings.NewReader(req))
		r.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			first <- -1
			return
		}
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	<-b.started
	if code, body := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, req); code != http.StatusConflict {
		t.Fatalf("concurrent resend: %d %s, want 409", code, body)
	}
	close(b.release)
	if code := <-first; code != 200 {
		t.Fatalf("first resend: %d", code)
	}
	if code, _ := do(t, "POST", srv.URL+"/v1/resend", "Bearer "+token, req); code != 200 {
		t.Fatalf("resend after the first finished: %d", code)
	}
}

// The API's empty-filter check (a 400 before the resend lock) agrees with
// the Resender's own (audit.ErrEmptyFilter), in dry run (no broker needed).
func TestEmptyFilterAgreesWithResender(t *testing.T) {
	st := sampleStore()
	r, err := audit.NewResender(audit.ResenderConfig{URI: "amqp://guest:guest@127.0.0.1:1/", Store: st})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, f := range []audit.Filter{
		{}, {Limit: 5}, {After: "cursor"}, {Headers: map[string]any{}}, {Limit: 5, After: "cursor", Headers: map[string]any{}},
		{MessageID: "m-1"}, {Queue: "billing"}, {Headers: map[string]any{"tenant": "acme"}}, {From: time.Unix(1, 0)}, {Outcome: audit.OutcomeRetry},
	} {
		_, err := r.Resend(context.Background(), f, audit.ResendOptions{Mode: audit.ResendToQueue, DryRun: true})
		if got, want := httpapi.EmptyFilter(f), errors.Is(err, audit.ErrEmptyFilter); got != want {
			t.Errorf("%+v: emptyFilter %v, Resender refuses it as empty %v (%v)", f, got, want, err)
		}
	}
}
