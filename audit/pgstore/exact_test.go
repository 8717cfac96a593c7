package pgstore

import (
	"context"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

// One message id with three arrivals: tenant A's on orders, tenant B's on
// payments, and a resent copy of B's (it only adds rabbitretry-resent).
// Search returns the arrival its filter matched, with the counts of
// matching arrivals and of different contents among them; the header
// table, the maybe_duplicate flag and an attempt's recorded_by come back
// as written (migration 0004).
func TestSearchPicksTheMatchingArrival(t *testing.T) {
	s := newTestStore(t)
	table := amqp.Table{"i32": int32(-7), "l": int64(1)<<53 + 1, "D": amqp.Decimal{Scale: 2, Value: 5}, "x": []byte{0, 1},
		"T": time.Unix(1_790_000_000, 0), "F": amqp.Table{"u8": uint8(1)}, "A": []any{float32(1.5), nil}}
	a := arrival("shared", t0)
	a.ID, a.Headers, a.Body, a.BodySize = "arr-a", map[string]any{"tenant": "A"}, []byte("A"), 1
	b := arrival("shared", t0.Add(time.Minute))
	b.ID, b.Exchange, b.Headers, b.Body, b.BodySize, b.HeaderTable = "arr-b", "payments", map[string]any{"tenant": "B"}, []byte("B"), 1, table
	resent := b
	resent.ID, resent.ArrivedAt, resent.MaybeDuplicate = "arr-b2", t0.Add(2*time.Minute), true
	resent.Headers = map[string]any{"tenant": "B", auditconst.ResentKey: "2026-11-26T08:00:00Z"}
	att := attempt("shared", 1, t0.Add(time.Second), audit.OutcomeSuccess)
	att.RecordedBy = "svc-recorder"
	if err := s.Write(context.Background(), []audit.Arrival{a, b, resent}, []audit.Attempt{att}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		f               audit.Filter
		id              string
		count, variants int
	}{
		{audit.Filter{MessageID: "shared"}, "arr-a", 3, 2},
		{audit.Filter{Exchange: "payments"}, "arr-b", 2, 1},
		{audit.Filter{Headers: map[string]any{"tenant": "A"}}, "arr-a", 1, 1},
		{audit.Filter{Headers: map[string]any{"tenant": "B"}, LastOutcome: audit.OutcomeSuccess}, "arr-b", 2, 1},
	} {
		msgs, err := s.Search(context.Background(), c.f)
		if err != nil || len(msgs) != 1 || msgs[0].Arrival == nil {
			t.Fatalf("%+v: %+v %v", c.f, msgs, err)
		}
		m := msgs[0]
		if m.Arrival.ID != c.id || m.ArrivalCount != c.count || m.ArrivalVariants != c.variants {
			t.Errorf("%+v: arrival %s count %d variants %d, want %s %d %d", c.f, m.Arrival.ID, m.ArrivalCount, m.ArrivalVariants, c.id, c.count, c.variants)
		}
		if m.Arrival.ID == "arr-b" && !reflect.DeepEqual(m.Arrival.HeaderTable, table) {
			t.Errorf("header table back %#v, want %#v", m.Arrival.HeaderTable, table)
		}
		if len(m.Attempts) != 1 || m.Attempts[0].RecordedBy != "svc-recorder" {
			t.Errorf("attempts %+v", m.Attempts)
		}
	}
	msgs, err := s.Search(context.Background(), audit.Filter{Exchange: "payments", After: ""})
	if err != nil || msgs[0].Arrival.MaybeDuplicate {
		t.Fatalf("first payments arrival flagged: %+v %v", msgs, err)
	}
	var dup bool
	if err := s.Pool().QueryRow(context.Background(), `SELECT maybe_duplicate FROM `+s.q.arrivals+` WHERE id = 'arr-b2'`).Scan(&dup); err != nil || !dup {
		t.Fatalf("maybe_duplicate of arr-b2: %v %v", dup, err)
	}
}
