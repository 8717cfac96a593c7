package pgstore

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
)

// batch returns n messages, each with an arrival and two attempts.
func batch(prefix string, n int, at time.Time) ([]audit.Arrival, []audit.Attempt) {
	var arr []audit.Arrival
	var att []audit.Attempt
	for i := range n {
		mid := fmt.Sprintf("%s-%05d", prefix, i)
		ts := at.Add(time.Duration(i) * time.Millisecond)
		arr = append(arr, arrival(mid, ts))
		att = append(att, attempt(mid, 1, ts.Add(time.Millisecond), audit.OutcomeRetry),
			attempt(mid, 2, ts.Add(3*time.Second), audit.OutcomeSuccess))
	}
	return arr, att
}

// The same batch written twice (a redelivery after a crash between commit
// and ack) and a batch overlapping it by half: every record stored once.
func TestWriteIdempotent(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	arr, att := batch("m", 100, t0)
	for range 2 {
		if err := s.Write(ctx, arr, att); err != nil {
			t.Fatal(err)
		}
		if a, b, m := counts(t, s); a != 100 || b != 200 || m != 100 {
			t.Fatalf("after writing 100 messages: arrivals=%d attempts=%d messages=%d, want 100/200/100", a, b, m)
		}
	}
	arr2, att2 := batch("m", 150, t0) // 0..99 again + 50 new
	// The same records repeated inside one call too.
	arr2 = append(arr2, arr2[:10]...)
	att2 = append(att2, att2[:10]...)
	if err := s.Write(ctx, arr2, att2); err != nil {
		t.Fatal(err)
	}
	if a, b, m := counts(t, s); a != 150 || b != 300 || m != 150 {
		t.Fatalf("after the overlapping batch: arrivals=%d attempts=%d messages=%d, want 150/300/150", a, b, m)
	}
	got, ok, err := s.Get(ctx, "m-00007")
	if err != nil || !ok {
		t.Fatalf("Get: %v %v", ok, err)
	}
	if got.Arrival == nil || got.Arrival.ID != "arr-m-00007" || len(got.Attempts) != 2 {
		t.Fatalf("Get = %+v, want its arrival and 2 attempts", got)
	}
	if _, ok, _ := s.Get(ctx, "nope"); ok {
		t.Fatal("Get(unknown) found something")
	}
	offered := 2*(len(arr)+len(att)) + len(arr2) + len(att2)
	t.Logf("ACCOUNT %s: offered=%d records in 3 Writes, stored=450 (150 arrivals, 300 attempts) duplicates=0 lost=0", t.Name(), offered)
}

// Concurrent writers of overlapping batches in different orders neither
// deadlock nor duplicate (rows are sorted by key inside Write).
func TestWriteConcurrentOverlap(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	arr, att := batch("c", 300, t0)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a, b := append([]audit.Arrival(nil), arr...), append([]audit.Attempt(nil), att...)
			if w%2 == 1 { // reversed order
				for i, j := 0, len(a)-1; i < j; i, j = i+1, j-1 {
					a[i], a[j] = a[j], a[i]
				}
				for i, j := 0, len(b)-1; i < j; i, j = i+1, j-1 {
					b[i], b[j] = b[j], b[i]
				}
			}
			errs <- s.Write(ctx, a, b)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if a, b, m := counts(t, s); a != 300 || b != 600 || m != 300 {
		t.Fatalf("arrivals=%d attempts=%d messages=%d, want 300/600/300", a, b, m)
	}
}

// Bodies come back byte-exact: every byte value, empty, nil (as empty),
// and a truncated body keeps its full size and marker.
func TestWriteBodiesByteExact(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	cases := map[string]struct {
		body      []byte
		size      int
		truncated bool
	}{
		"all256":    {all, 256, false},
		"empty":     {[]byte{}, 0, false},
		"nil":       {nil, 0, false},
		"truncated": {all[:16], 1 << 20, true},
		"invalid":   {[]byte{0xff, 0xfe, 0x00, 0xc3, 0x28}, 5, false},
	}
	var arr []audit.Arrival
	for mid, c := range cases {
		a := arrival(mid, t0)
		a.Body, a.BodySize, a.BodyTruncated = c.body, c.size, c.truncated
		arr = append(arr, a)
	}
	if err := s.Write(ctx, arr, nil); err != nil {
		t.Fatal(err)
	}
	for mid, c := range cases {
		m, ok, err := s.Get(ctx, mid)
		if err != nil || !ok || m.Arrival == nil {
			t.Fatalf("Get(%s): %+v %v %v", mid, m, ok, err)
		}
		want := c.body
		if want == nil {
			want = []byte{}
		}
		if !bytes.Equal(m.Arrival.Body, want) || m.Arrival.Body == nil {
			t.Errorf("%s: body %x, want %x", mid, m.Arrival.Body, want)
		}
		if m.Arrival.BodySize != c.size || m.Arrival.BodyTruncated != c.truncated {
			t.Errorf("%s: size %d truncated %v, want %d %v", mid, m.Arrival.BodySize, m.Arrival.BodyTruncated, c.size, c.truncated)
		}
	}
}

// Every field round-trips (times at microsecond resolution, durations at
// the column's unit), including headers of every JSON type and properties.
func TestWriteRoundTrip(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	at := time.Date(2026, 1, 2, 3, 4, 5, 123456789, time.UTC)
	a := audit.Arrival{
		ID: "a1", MessageID: "m1", CorrelationID: "corr-1", Exchange: "ex", RoutingKey: "rk.1",
		PublishedAt: at.Add(-time.Second), ArrivedAt: at,
		Headers: map[string]any{"s": "x", "n": 1.5, "b": true, "nil": nil, "list": []any{"a", 2.0},
			"table": map[string]any{"k": "v"}, "x-death": []any{map[string]any{"count": 2.0, "queue": "q"}}},
		Properties: map[string]string{"content-type": "text/plain", "delivery-mode": "2"},
		Body:       []byte("hi"), BodySize: 2,
	}
	b := audit.Attempt{
		ID: "t1", MessageID: "m1", CorrelationID: "corr-1", Queue: "q", Attempt: 3, StartedAt: at,
		Duration: 2*time.Second + 345678*time.Nanosecond, Outcome: audit.OutcomePoisoned,
		Delay: 1500 * time.Millisecond, Tier: 5 * time.Second, ErrorClass: "exhausted", Error: "boom",
	}
	if err := s.Write(ctx, []audit.Arrival{a}, []audit.Attempt{b}); err != nil {
		t.Fatal(err)
	}
	m, _, err := s.Get(ctx, "m1")
	if err != nil {
		t.Fatal(err)
	}
	ga, gb := *m.Arrival, m.Attempts[0]
	if !ga.ArrivedAt.Equal(at.Truncate(time.Microsecond)) || !ga.PublishedAt.Equal(at.Add(-time.Second).Truncate(time.Microsecond)) {
		t.Errorf("times %v %v", ga.ArrivedAt, ga.PublishedAt)
	}
	if fmt.Sprint(ga.Headers) != fmt.Sprint(a.Headers) || fmt.Sprint(ga.Properties) != fmt.Sprint(a.Properties) {
		t.Errorf("headers %v properties %v, want %v %v", ga.Headers, ga.Properties, a.Headers, a.Properties)
	}
	if ga.CorrelationID != "corr-1" || ga.Exchange != "ex" || ga.RoutingKey != "rk.1" {
		t.Errorf("arrival %+v", ga)
	}
	if gb.Duration != 2*time.Second+345*time.Microsecond || gb.Delay != a2d(1500) || gb.Tier != 5*time.Second ||
		gb.Attempt != 3 || gb.Outcome != audit.OutcomePoisoned || gb.ErrorClass != "exhausted" || gb.Error != "boom" ||
		gb.Queue != "q" || gb.CorrelationID != "corr-1" || !gb.StartedAt.Equal(at.Truncate(time.Microsecond)) {
		t.Errorf("attempt %+v", gb)
	}
	// No publish timestamp: zero back.
	a.ID, a.MessageID, a.PublishedAt, a.Headers, a.Properties = "a2", "m2", time.Time{}, nil, nil
	if err := s.Write(ctx, []audit.Arrival{a}, nil); err != nil {
		t.Fatal(err)
	}
	m, _, _ = s.Get(ctx, "m2")
	if !m.Arrival.PublishedAt.IsZero() || m.Arrival.Headers != nil || m.Arrival.Properties != nil {
		t.Errorf("m2 arrival %+v, want zero PublishedAt, nil maps", m.Arrival)
	}
}

func a2d(ms int) time.Duration { return time.Duration(ms) * time.Millisecond }

// Content PostgreSQL cannot hold never fails a write (the consumer would
// redeliver it forever): NUL and invalid UTF-8 become U+FFFD, unencodable
// header values their text. A record without ID is refused, whole batch.
func TestWriteHostileContent(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	a := arrival("nul\x00id", t0)
	a.RoutingKey = "rk\xff\x00"
	a.Headers = map[string]any{"k\x00": "v\x00\xff", "nan": math.NaN(), "nested": map[string]any{"x": []any{"\x00"}}}
	b := attempt("nul\x00id", 1, t0, audit.OutcomeRetry)
	b.Error = "bad \x00 byte \xc3\x28"
	if err := s.Write(ctx, []audit.Arrival{a}, []audit.Attempt{b}); err != nil {
		t.Fatalf("Write of hostile content: %v", err)
	}
	m, ok, err := s.Get(ctx, "nul\uFFFDid")
	if err != nil || !ok {
		t.Fatalf("Get: %v %v", ok, err)
	}
	if m.Arrival.RoutingKey != "rk\uFFFD\uFFFD" || m.Attempts[0].Error != "bad \uFFFD byte \uFFFD(" {
		t.Errorf("cleaned text: %q %q", m.Arrival.RoutingKey, m.Attempts[0].Error)
	}
	if m.Arrival.Headers["k\uFFFD"] != "v\uFFFD\uFFFD" || m.Arrival.Headers["nan"] != "NaN" {
		t.Errorf("cleaned headers: %#v", m.Arrival.Headers)
	}

	bad := []audit.Attempt{attempt("x", 1, t0, audit.OutcomeSuccess), {MessageID: "y"}}
	err = s.Write(ctx, nil, bad)
	if err == nil || !strings.Contains(err.Error(), "attempts[1].ID is empty") {
		t.Fatalf("Write(empty ID) = %v", err)
	}
	if _, ok, _ := s.Get(ctx, "x"); ok {
		t.Fatal("a batch with an invalid record was partly written")
	}
	if err := s.Write(ctx, nil, nil); err != nil {
		t.Fatalf("Write(nothing) = %v", err)
	}
}

// The messages row follows the latest attempt whatever order the attempts
// are written in (LastOutcome).
func TestWriteLastOutcomeOrderIndependent(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	a1 := attempt("m", 1, t0, audit.OutcomeRetry)
	a2 := attempt("m", 2, t0.Add(time.Second), audit.OutcomeRetry)
	a3 := attempt("m", 3, t0.Add(2*time.Second), audit.OutcomePoisoned)
	for _, w := range [][]audit.Attempt{{a3}, {a1, a2}, {a2}} {
		if err := s.Write(ctx, nil, w); err != nil {
			t.Fatal(err)
		}
	}
	var last string
	var n int
	if err := s.pool.QueryRow(ctx, `SELECT last_outcome, last_attempt FROM `+s.q.messages+` WHERE message_id = 'm'`).Scan(&last, &n); err != nil {
		t.Fatal(err)
	}
	if last != "poisoned" || n != 3 {
		t.Fatalf("last = %s/%d, want poisoned/3", last, n)
	}
}

// Arrivals without a message id (published with neither a UUID header nor
// a message-id) are listed one by one, under their record ID, never merged.
func TestWriteArrivalsWithoutMessageID(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	a1, a2 := arrival("", t0), arrival("", t0.Add(time.Second))
	a1.ID, a2.ID = "sha-1", "sha-2"
	a2.Body = []byte("second")
	withID := arrival("m-1", t0.Add(2*time.Second))
	// An attempt whose message id is empty must not be mistaken for them.
	stray := attempt("", 1, t0, audit.OutcomeSuccess)
	if err := s.Write(ctx, []audit.Arrival{a1, a2, withID}, []audit.Attempt{stray}); err != nil {
		t.Fatal(err)
	}
	got, err := s.Search(ctx, audit.Filter{Exchange: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(ids(got), []string{"m-1", "sha-2", "sha-1"}) {
		t.Fatalf("Search = %v, want m-1, sha-2, sha-1", ids(got))
	}
	if got[1].Arrival == nil || string(got[1].Arrival.Body) != "second" || got[1].Arrival.MessageID != "" || len(got[1].Attempts) != 0 {
		t.Fatalf("sha-2 = %+v", got[1])
	}
	m, ok, err := s.Get(ctx, "sha-1")
	if err != nil || !ok || m.Arrival == nil || m.Arrival.ID != "sha-1" {
		t.Fatalf("Get(sha-1) = %+v %v %v", m, ok, err)
	}
	m, ok, err = s.Get(ctx, "")
	if err != nil || !ok || m.Arrival != nil || len(m.Attempts) != 1 {
		t.Fatalf("Get(\"\") = %+v %v %v, want the stray attempt only", m, ok, err)
	}
	res, err := s.Prune(ctx, t0.Add(time.Hour), 0)
	if err != nil || res.Arrivals != 3 || res.Attempts != 1 || res.Messages != 4 {
		t.Fatalf("Prune = %+v, %v; want 3 arrivals, 1 attempt, 4 messages", res, err)
	}
}

// Times come back in UTC whatever zone they were written in.
func TestReadTimesUTC(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	zone := time.FixedZone("X", 5*3600+1800)
	a := arrival("z", t0.In(zone))
	b := attempt("z", 1, t0.Add(time.Second).In(zone), audit.OutcomeSuccess)
	if err := s.Write(ctx, []audit.Arrival{a}, []audit.Attempt{b}); err != nil {
		t.Fatal(err)
	}
	m, _, err := s.Get(ctx, "z")
	if err != nil {
		t.Fatal(err)
	}
	for name, tm := range map[string]time.Time{"arrived": m.Arrival.ArrivedAt, "published": m.Arrival.PublishedAt, "started": m.Attempts[0].StartedAt} {
		if tm.Location() != time.UTC {
			t.Errorf("%s at %v, want UTC", name, tm)
		}
	}
	if !m.Arrival.ArrivedAt.Equal(t0) || !m.Attempts[0].StartedAt.Equal(t0.Add(time.Second)) {
		t.Errorf("times %v %v", m.Arrival.ArrivedAt, m.Attempts[0].StartedAt)
	}
}
