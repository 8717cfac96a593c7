package audit

import (
	"context"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// rowsLog is a Store whose delivery log has rows only (no records).
type rowsLog struct {
	deliverylog.Offer[Arrival, Attempt] // of itself
	mu                                  sync.Mutex
	rows                                map[string]unackedDelivery
	// beforeTake, if set, runs (unlocked) at the start of TakeAckingDelivery.
	beforeTake func()
}

// newRowsLog returns an empty rowsLog offering itself as its delivery log.
func newRowsLog() *rowsLog {
	l := &rowsLog{rows: map[string]unackedDelivery{}}
	l.Offer = deliverylog.NewOffer[Arrival, Attempt](l)
	return l
}

func (l *rowsLog) Write(context.Context, []Arrival, []Attempt) error { return nil }
func (l *rowsLog) Search(context.Context, Filter) ([]Message, error) { return nil, nil }
func (l *rowsLog) WriteDeliveries(_ context.Context, _ []Arrival, _ []Attempt, d []unackedDelivery) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, x := range d {
		l.rows[x.ArrivalID] = x
	}
	return nil
}
func (l *rowsLog) UnackedDeliveries(_ context.Context, fps []string) ([]unackedDelivery, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []unackedDelivery
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
func (l *rowsLog) TakeAckingDelivery(_ context.Context, id, session string) (bool, error) {
	if l.beforeTake != nil {
		l.beforeTake()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	r, ok := l.rows[id]
	if !ok || r.Session != session || !r.Acking {
		return false, nil
	}
	delete(l.rows, id)
	return true, nil
}
func (l *rowsLog) DeliveriesAcking(context.Context, string, []string) error { return nil }
func (l *rowsLog) DeliveriesNotAcked(_ context.Context, session string, ids []string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		if r, ok := l.rows[id]; ok && r.Session == session {
			r.Acking = false
			l.rows[id] = r
		}
	}
	return nil
}

// A session's exclusive queue tells its liveness on the real broker: 405
// (alive) while its connection is open, 404 (ended) once it closed. A
// redelivered arrival claims the row of an ended session, not the row of
// identical content held by a live session (another publish): with two
// rows of one fingerprint, one of each, and two redeliveries, the first
// takes the ended session's arrival ID, the second is a new arrival, not
// flagged. A row of an ended session that was acking (its ack may have
// reached RabbitMQ) is never claimed: its redelivery takes it (deletes
// it) and is a new arrival flagged maybe_duplicate; one whose mark is
// cleared under the take (the ack was not sent) is claimed after all.
func TestSessionLivenessAndClaims(t *testing.T) {
	uri := testkit.URI(t)
	log := newRowsLog()
	c, err := NewConsumer(ConsumerConfig{URI: uri, Store: log, Naming: Naming{
		Exchange: testkit.UniqueName(t, "audit") + ".x", ArrivalsQueue: testkit.UniqueName(t, "audit") + ".arrivals",
		AttemptsQueue: testkit.UniqueName(t, "audit") + ".attempts",
	}})
	if err != nil {
		t.Fatal(err)
	}
	if c.log == nil {
		t.Fatal("the Consumer did not find the store's delivery log")
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
	_ = log.WriteDeliveries(context.Background(), nil, nil, []unackedDelivery{
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
	_ = log.WriteDeliveries(context.Background(), nil, nil, []unackedDelivery{{ArrivalID: "acked-by-ended", Fingerprint: fpAcked, Session: endedTok, Acking: true}})
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
	if r, ok := log.rows["acked-by-ended"]; ok {
		t.Errorf("acking row not taken: %+v", r)
	}

	// The session clears the acking mark (its ack could not be sent) while
	// the redelivery is taking the row: the take fails, the rows are read
	// again, and the redelivery claims the row, not flagged.
	_ = log.WriteDeliveries(context.Background(), nil, nil, []unackedDelivery{{ArrivalID: "unmarked-by-ended", Fingerprint: fpAcked, Session: endedTok, Acking: true}})
	log.beforeTake = func() { _ = log.DeliveriesNotAcked(context.Background(), endedTok, []string{"unmarked-by-ended"}) }
	b = &batch{
		arrivals: []Arrival{{ID: "new-4", contentID: "content-acked"}}, fps: []string{fpAcked},
		redelivered: []bool{true}, resolved: []bool{false}, claimed: []bool{false},
	}
	if err := c.claimRedelivered(context.Background(), me, myTok, b); err != nil {
		t.Fatal(err)
	}
	if b.arrivals[0].ID != "unmarked-by-ended" || !b.claimed[0] || b.arrivals[0].MaybeDuplicate {
		t.Errorf("redelivery matching a row unmarked under its take: %+v claimed %v, want the row claimed", b.arrivals[0], b.claimed[0])
	}
}
