package audit

import (
	"context"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// rowsLog is a DeliveryLog of rows only (no records).
type rowsLog struct {
	mu   sync.Mutex
	rows map[string]UnackedDelivery
}

func (l *rowsLog) Write(context.Context, []Arrival, []Attempt) error { return nil }
func (l *rowsLog) Search(context.Context, Filter) ([]Message, error) { return nil, nil }
func (l *rowsLog) WriteDeliveries(_ context.Context, _ []Arrival, _ []Attempt, d []UnackedDelivery) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, x := range d {
		l.rows[x.ArrivalID] = x
	}
	return nil
}
func (l *rowsLog) UnackedDeliveries(_ context.Context, fps []string) ([]UnackedDelivery, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []UnackedDelivery
	for _, r := range l.rows {
		for _, f := range fps {
			if r.Fingerprint == f {
				out = append(out, r)
			}
		}
	}
	return out, nil
}
func (l *rowsLog) ClaimDelivery(_ context.Context, id, from, to string) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r, ok := l.rows[id]
	if !ok || r.Session != from || r.Acking {
		return false, nil
	}
	r.Session = to
	l.rows[id] = r
	return true, nil
}
func (l *rowsLog) DeliveriesAcking(context.Context, string, []string) error   { return nil }
func (l *rowsLog) DeliveriesNotAcked(context.Context, string, []string) error { return nil }

// A session's exclusive queue tells its liveness on the real broker: 405
// (alive) while its connection is open, 404 (ended) once it closed. A
// redelivered arrival claims the row of an ended session, not the row of
// identical content held by a live session (another publish): with two
// rows of one fingerprint, one of each, and two redeliveries, the first
// takes the ended session's arrival ID, the second is a new arrival, not
// flagged. A row of an ended session that was acking (its ack may have
// reached RabbitMQ) is never claimed: its redelivery is a new arrival
// flagged maybe_duplicate.
func TestSessionLivenessAndClaims(t *testing.T) {
	uri := testkit.URI(t)
	log := &rowsLog{rows: map[string]UnackedDelivery{}}
	c, err := NewConsumer(ConsumerConfig{URI: uri, Store: log, Naming: Naming{
		Exchange: testkit.UniqueName(t, "audit") + ".x", ArrivalsQueue: testkit.UniqueName(t, "audit") + ".arrivals",
		AttemptsQueue: testkit.UniqueName(t, "audit") + ".attempts",
	}})
	if err != nil {
		t.Fatal(err)
	}
	dial := func() *amqp.Connection {
		conn, err := amqp.Dial(uri)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	live, ended, me := dial(), dial(), dial()
	liveTok, endedTok, myTok := randomToken(), randomToken(), randomToken()
	for _, s := range []struct {
		conn *amqp.Connection
		tok  string
	}{{live, liveTok}, {ended, endedTok}, {me, myTok}} {
		if err := c.holdSession(s.conn, s.tok); err != nil {
			t.Fatal(err)
		}
	}
	if st := c.sessionState(me, liveTok); st != sessionAlive {
		t.Fatalf("live session: state %v, want alive (405)", st)
	}
	if err := ended.Close(); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 10*time.Second, "the closed session's queue gone (404)", func() bool { return c.sessionState(me, endedTok) == sessionEnded })

	fp := fingerprint(c.cfg.Naming.ArrivalsQueue, "content")
	_ = log.WriteDeliveries(context.Background(), nil, nil, []UnackedDelivery{
		{ArrivalID: "stored-by-live", Fingerprint: fp, Session: liveTok},
		{ArrivalID: "stored-by-ended", Fingerprint: fp, Session: endedTok},
	})
	b := &batch{
		arrivals:    []Arrival{{ID: "new-1", contentID: "content"}, {ID: "new-2", contentID: "content"}},
		fps:         []string{fp, fp},
		redelivered: []bool{true, true}, resolved: []bool{false, false}, claimed: []bool{false, false},
	}
	if err := c.claimRedelivered(context.Background(), me, myTok, b); err != nil {
		t.Fatal(err)
	}
	if b.arrivals[0].ID != "stored-by-ended" || !b.claimed[0] || b.arrivals[0].MaybeDuplicate {
		t.Errorf("first redelivery: %+v claimed %v, want the ended session's arrival", b.arrivals[0], b.claimed[0])
	}
	if b.arrivals[1].ID != "new-2" || b.claimed[1] || b.arrivals[1].MaybeDuplicate || !b.resolved[1] {
		t.Errorf("second redelivery: %+v claimed %v, want a new, unflagged arrival", b.arrivals[1], b.claimed[1])
	}
	if r := log.rows["stored-by-ended"]; r.Session != myTok {
		t.Errorf("claimed row's session %q, want this one's", r.Session)
	}
	if r := log.rows["stored-by-live"]; r.Session != liveTok {
		t.Errorf("live session's row moved to %q", r.Session)
	}

	fpAcked := fingerprint(c.cfg.Naming.ArrivalsQueue, "content-acked")
	_ = log.WriteDeliveries(context.Background(), nil, nil, []UnackedDelivery{{ArrivalID: "acked-by-ended", Fingerprint: fpAcked, Session: endedTok, Acking: true}})
	b = &batch{
		arrivals: []Arrival{{ID: "new-3", contentID: "content-acked"}}, fps: []string{fpAcked},
		redelivered: []bool{true}, resolved: []bool{false}, claimed: []bool{false},
	}
	if err := c.claimRedelivered(context.Background(), me, myTok, b); err != nil {
		t.Fatal(err)
	}
	if b.arrivals[0].ID != "new-3" || b.claimed[0] || !b.arrivals[0].MaybeDuplicate || !b.resolved[0] {
		t.Errorf("redelivery matching an acking row: %+v claimed %v, want a new arrival flagged maybe_duplicate", b.arrivals[0], b.claimed[0])
	}
	if r := log.rows["acked-by-ended"]; r.Session != endedTok {
		t.Errorf("acking row moved to %q", r.Session)
	}
}
