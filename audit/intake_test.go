package audit_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/memstore"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// dropper records the TCP connections a Consumer dials, so a test can
// drop them (a connection loss as the broker sees it: every unacked
// delivery is returned and counted, "Quorum Queues", "When is delivery
// count incremented?").
type dropper struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (d *dropper) config() *amqp.Config {
	dial := amqp.DefaultDial(10 * time.Second)
	return &amqp.Config{Heartbeat: 10 * time.Second, Dial: func(network, addr string) (net.Conn, error) {
		c, err := dial(network, addr)
		if err == nil {
			d.mu.Lock()
			d.conns = append(d.conns, c)
			d.mu.Unlock()
		}
		return c, err
	}}
}

// drop closes every connection dialled so far and returns how many.
func (d *dropper) drop() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := len(d.conns)
	for _, c := range d.conns {
		_ = c.Close()
	}
	d.conns = nil
	return n
}

// offerStore remembers the arrival IDs offered to Write since reset.
type offerStore struct {
	*memstore.Store
	selfOffer // offerLog: shadows the embedded store's own offer
	mu        sync.Mutex
	seen      map[string]bool
}

func (s *offerStore) Write(ctx context.Context, arr []audit.Arrival, att []audit.Attempt) error {
	s.mu.Lock()
	if s.seen == nil {
		s.seen = map[string]bool{}
	}
	for _, a := range arr {
		s.seen[a.ID] = true
	}
	s.mu.Unlock()
	return s.Store.Write(ctx, arr, att)
}

// offerLog is the embedded store's delivery log, its WriteDeliveries going
// through offerStore's: offerStore's delivery log.
type offerLog struct {
	deliveryLog
	s *offerStore
}

// newOfferStore returns an offerStore over a new memstore.
func newOfferStore() *offerStore {
	s := &offerStore{Store: memstore.New()}
	s.selfOffer = offerOf(offerLog{s.Store.DeliveryLog(), s})
	return s
}

func (l offerLog) WriteDeliveries(ctx context.Context, arr []audit.Arrival, att []audit.Attempt, dels []unackedDelivery) error {
	return l.s.WriteDeliveries(ctx, arr, att, dels)
}

// WriteDeliveries is Write for the Consumer's delivery-log path.
func (s *offerStore) WriteDeliveries(ctx context.Context, arr []audit.Arrival, att []audit.Attempt, dels []unackedDelivery) error {
	s.mu.Lock()
	if s.seen == nil {
		s.seen = map[string]bool{}
	}
	for _, a := range arr {
		s.seen[a.ID] = true
	}
	s.mu.Unlock()
	return s.Store.DeliveryLog().WriteDeliveries(ctx, arr, att, dels)
}

func (s *offerStore) offered() map[string]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.seen)
}

func (s *offerStore) reset() {
	s.mu.Lock()
	s.seen = nil
	s.mu.Unlock()
}

// TestConsumerHoldsRecordsThroughConnectionLosses: PostgreSQL is down, the
// consumer holds 200 arrivals unacked, and its connection is closed over
// and over (100 times, the TCP connection dropped). Each close counts
// as a delivery of every held record (quorum queue delivery-count); on 4.x
// the default delivery limit (20) used to drop them all. The audit queues
// now carry a large delivery limit (audit.DeliveryLimit) and a dead-letter
// target, so every record is stored once the store is back.
func TestConsumerHoldsRecordsThroughConnectionLosses(t *testing.T) {
	holdThroughLosses(t, newBrokerEnv(t), 100)
}

// TestConsumerUpgradedQueuesHoldRecords: audit queues declared by an older
// version (quorum, no arguments: RabbitMQ cannot change them) get the
// README's upgrade policy (delivery-limit, dead-letter target); the
// Consumer uses them as they are, and they too keep every record through
// 100 connection losses. Without the policy RabbitMQ 4.x drops them all
// after 20.
func TestConsumerUpgradedQueuesHoldRecords(t *testing.T) {
	testkit.HaveCtl(t)
	e := newBrokerEnv(t)
	for _, q := range []string{e.naming.ArrivalsQueue, e.naming.AttemptsQueue} {
		if _, err := e.ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			t.Fatal(err)
		}
	}
	applyUpgradePolicy(t, e, audit.DeliveryLimit)
	holdThroughLosses(t, e, 100)
}

// TestConsumerHoldsRecordsThroughBrokerClosedConnections is
// TestConsumerHoldsRecordsThroughConnectionLosses with the broker closing
// the consumer's connection (rabbitmqctl close_connection, found by its
// connection name), 25 times: past 4.x's default delivery limit of 20.
// About 3 s per close (three rabbitmqctl calls): RABBITRETRY_FAULTS=1 only.
func TestConsumerHoldsRecordsThroughBrokerClosedConnections(t *testing.T) {
	if os.Getenv("RABBITRETRY_FAULTS") != "1" {
		t.Skip("a fault run (about 80 s): set RABBITRETRY_FAULTS=1")
	}
	testkit.HaveCtl(t)
	e := newBrokerEnv(t)
	name := e.prefix + ".consumer"
	holdThrough(t, e, 25, func(cfg *audit.ConsumerConfig) { cfg.ConnectionName = name }, func() int {
		n := 0
		for _, pid := range connectionPIDs(t, name) {
			if _, err := testkit.Ctl(t, 30*time.Second, "close_connection", pid, "rabbitretry audit test: connection loss during a store outage"); err == nil {
				n++
			}
		}
		return n
	})
}

// connectionPIDs returns the pids (as close_connection takes them) of the
// broker's connections whose client-provided name is name: the JSON
// listing has the names, the plain one the pids; joined on the peer port.
func connectionPIDs(t *testing.T, name string) []string {
	t.Helper()
	out, err := testkit.Ctl(t, 30*time.Second, "-q", "list_connections", "peer_port", "client_properties", "--formatter", "json")
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		PeerPort int             `json:"peer_port"`
		Props    json.RawMessage `json:"client_properties"` // a list of [key, type, value], or "" for some connections
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("parsing list_connections: %v\n%s", err, out)
	}
	ports := map[string]bool{}
	for _, r := range rows {
		var props [][]json.RawMessage
		_ = json.Unmarshal(r.Props, &props)
		for _, p := range props {
			var k, v string
			if len(p) == 3 && json.Unmarshal(p[0], &k) == nil && k == "connection_name" && json.Unmarshal(p[2], &v) == nil && v == name {
				ports[fmt.Sprint(r.PeerPort)] = true
			}
		}
	}
	plain, err := testkit.Ctl(t, 30*time.Second, "-q", "list_connections", "pid", "peer_port")
	if err != nil {
		t.Fatal(err)
	}
	var pids []string
	for _, line := range strings.Split(plain, "\n") {
		if f := strings.Fields(line); len(f) == 2 && strings.HasPrefix(f[0], "<") && ports[f[1]] {
			pids = append(pids, f[0])
		}
	}
	return pids
}

// applyUpgradePolicy sets the README's upgrade policy (with delivery-limit
// limit) on e's arrivals and attempts queues, cleared at the end.
func applyUpgradePolicy(t *testing.T, e *brokerEnv, limit int) {
	t.Helper()
	n := e.naming.WithDefaults()
	def := fmt.Sprintf(`{"delivery-limit":%d,"dead-letter-exchange":%q,"dead-letter-routing-key":%q,"dead-letter-strategy":"at-least-once","overflow":"reject-publish"}`,
		limit, n.Exchange, audit.SetAsideRoutingKey)
	pattern := "^" + regexp.QuoteMeta(e.prefix) + `\.(arrivals|attempts)$`
	if _, err := testkit.Ctl(t, 60*time.Second, "set_policy", "--apply-to", "queues", "--priority", "10", e.prefix, pattern, def); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testkit.Ctl(t, 60*time.Second, "clear_policy", e.prefix) })
}

// holdThroughLosses publishes 200 messages while the store is down, drops
// the consumer's connection closes times, then brings the store back and
// accounts for every record.
func holdThroughLosses(t *testing.T, e *brokerEnv, closes int) {
	t.Helper()
	var d dropper
	holdThrough(t, e, closes, func(cfg *audit.ConsumerConfig) { cfg.AmqpConfig = d.config() }, d.drop)
}

// holdThrough is holdThroughLosses with the connection configured by mod
// and lost by drop (which returns how many connections it closed).
func holdThrough(t *testing.T, e *brokerEnv, closes int, mod func(*audit.ConsumerConfig), drop func() int) {
	t.Helper()
	store := newOfferStore()
	store.SetDown(true)
	_, _ = e.consumer(store, func(cfg *audit.ConsumerConfig) {
		mod(cfg)
		cfg.ReconnectBackoff = func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) }
	})
	const n = 200
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("%s-%03d", e.prefix, i), []byte(fmt.Sprintf(`{"n":%d}`, i)))
	}
	e.publish(msgs...)
	// offered: has the consumer offered all n records to the (down) store
	// since the last reset? Then its session holds every one of them.
	offered := func() bool { return len(store.offered()) == n }
	testkit.WaitFor(t, 10*time.Second, "the consumer to hold every arrival", offered)
	done := 0
	for range closes {
		store.reset()
		if drop() == 0 {
			t.Fatal("no connection to drop")
		}
		// Every held record is delivered again, unless a delivery limit
		// dropped it (then the loop stops and the account shows it).
		deadline := time.Now().Add(10 * time.Second)
		for !offered() && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond) // polling; the deadline decides
		}
		done++
		if !offered() {
			t.Logf("after %d connection losses only %d of %d records were delivered again", done, len(store.offered()), n)
			break
		}
	}
	store.SetDown(false)
	stored := func() int { a, _, _, _, _ := store.Counts(); return a }
	deadline := time.Now().Add(20 * time.Second)
	for stored() < n && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond) // polling the store; not synchronisation
	}
	got := stored()
	setAside := e.ready(e.naming.WithDefaults().SetAsideQueue)
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d (connection closes=%d)",
		t.Name(), n, got, setAside, 0, n-got-setAside, done)
	if got != n {
		t.Fatalf("%d of %d records stored after %d connection losses (set aside %d)", got, n, done, setAside)
	}
}

// publishRaw publishes ps to e's business exchange with routingKey,
// confirmed.
func (e *brokerEnv) publishRaw(ps ...amqp.Publishing) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		e.t.Fatal(err)
	}
	for _, p := range ps {
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), e.exchange, routingKey, true, false, p)
		if err != nil {
			e.t.Fatal(err)
		}
		if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
			e.t.Fatalf("publish not confirmed: %v %v", ok, err)
		}
	}
}

func uuidPublishing(id string, ts time.Time) amqp.Publishing {
	return amqp.Publishing{Headers: amqp.Table{audit.DefaultUUIDHeader: id}, Timestamp: ts,
		DeliveryMode: amqp.Persistent, Body: []byte(`{"id":"` + id[:min(len(id), 40)] + `"}`)}
}

// TestConsumerSetsAsideRecordsPostgresRefuses: among 300 ordinary
// messages, one whose message id is 8,000 bytes (PostgreSQL: index row
// too big, SQLSTATE 54000) and two whose AMQP timestamps are +10^13 s
// (22008) and -10^13 s (stored as year 269636). Every write error used to
// be retried forever in batch order: the audit stalled. Now the long id is
// set aside with its reason (Consumer stats, pgstore stats), the
// out-of-range timestamps are stored as absent with a note, and every
// other record is stored within seconds.
func TestConsumerSetsAsideRecordsPostgresRefuses(t *testing.T) {
	e := newBrokerEnv(t)
	st, read := pgStore(t)
	c, _ := e.consumer(st, nil)
	const ordinary = 300
	longID := e.prefix + "-" + strings.Repeat("x", 8000)
	now := time.Now()
	var ps []amqp.Publishing
	for i := range ordinary {
		switch i {
		case 50:
			ps = append(ps, uuidPublishing(longID, now))
		case 150:
			ps = append(ps, uuidPublishing(e.prefix+"-future", time.Unix(1e13, 0)))
		case 250:
			ps = append(ps, uuidPublishing(e.prefix+"-past", time.Unix(-1e13, 0)))
		}
		ps = append(ps, uuidPublishing(fmt.Sprintf("%s-%03d", e.prefix, i), now))
	}
	e.publishRaw(ps...)
	published := len(ps)
	ctx := context.Background()
	testkit.WaitFor(t, 30*time.Second, "every record stored or set aside", func() bool {
		s, err := st.Stats(ctx)
		return err == nil && s.Arrivals+s.SetAside >= int64(published)
	})
	arr, _ := read()
	stored, dups := 0, 0
	for _, a := range arr {
		stored++
		dups += len(a) - 1
	}
	s, err := st.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d",
		t.Name(), published, stored, s.SetAside, dups, published-stored-int(s.SetAside))
	if stored != published-1 || s.SetAside != 1 || dups != 0 || c.Stats().SetAside != 1 {
		t.Fatalf("stored %d (dups %d), set aside %d (consumer %d); want %d and 1", stored, dups, s.SetAside, c.Stats().SetAside, published-1)
	}
	if r := s.SetAsideRecent[0]; r.Kind != auditconst.KindArrival || !strings.Contains(r.Reason, "MessageID is 8") || len(r.MessageID) > 256 {
		t.Fatalf("set aside: %+v", r)
	}
	for _, id := range []string{e.prefix + "-future", e.prefix + "-past"} {
		var pub *time.Time
		var note string
		if err := st.Pool().QueryRow(ctx, `SELECT published_at, properties->>$2 FROM `+st.Schema()+`.arrivals WHERE message_id = $1`,
			id, audit.TimestampErrorProperty).Scan(&pub, &note); err != nil {
			t.Fatal(err)
		}
		if pub != nil || !strings.Contains(note, "outside years 1-9999") {
			t.Fatalf("%s: published_at %v, note %q; want absent with a note", id, pub, note)
		}
	}
}

// TestConsumerSetsAsideUndecodableMessage: a header table nested 40 deep
// and one with 9,000 keys (RabbitMQ accepts both; amqp091-go refuses more
// than 32 levels or 8192 entries) make the AMQP client close the
// consumer's connection on every delivery. The consumer used to loop with
// its whole prefetch held, so the broker's delivery limit dropped the bad
// message and its innocent neighbours. Now, after such a close, it
// consumes one message at a time: only the bad message is counted, and the
// queue's delivery limit (here 5, by policy, as the README's upgrade
// policy would set it) dead-letters it to the set-aside queue. Every
// innocent record is stored, and Stats().Undecodable shows the loop.
func TestConsumerSetsAsideUndecodableMessage(t *testing.T) {
	testkit.HaveCtl(t)
	e := newBrokerEnv(t)
	store := memstore.New()
	cfg := audit.ConsumerConfig{URI: e.uri, Store: store, Naming: e.naming,
		Exchanges: []audit.Binding{{Exchange: e.exchange, RoutingKey: routingKey}}}
	pre, err := audit.NewConsumer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := pre.Declare(); err != nil {
		t.Fatal(err)
	}
	const limit = 5
	applyUpgradePolicy(t, e, limit)
	deep := amqp.Table{"leaf": int32(1)}
	for range 40 {
		deep = amqp.Table{"n": deep}
	}
	wide := amqp.Table{}
	for i := range 9000 {
		wide[fmt.Sprintf("k%04d", i)] = int32(i)
	}
	var ps []amqp.Publishing
	innocent := 0
	for i := range 60 {
		if i == 20 || i == 40 {
			p := uuidPublishing(fmt.Sprintf("%s-bad-%d", e.prefix, i), time.Now())
			p.Headers["bad"] = map[bool]amqp.Table{true: deep, false: wide}[i == 20]
			ps = append(ps, p)
		}
		ps = append(ps, uuidPublishing(fmt.Sprintf("%s-%03d", e.prefix, i), time.Now()))
		innocent++
	}
	e.publishRaw(ps...)
	c, _ := e.consumer(store, nil)
	setAside := func() int { return e.ready(e.naming.WithDefaults().SetAsideQueue) }
	stored := func() int { a, _, _, _, _ := store.Counts(); return a }
	// Wait until every message is stored or set aside (or the time is up:
	// the account shows what is missing).
	deadline := time.Now().Add(60 * time.Second)
	for stored()+setAside() < len(ps) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond) // polling; the deadline decides
	}
	got, aside := stored(), setAside()
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d (undecodable connection closes=%d)",
		t.Name(), len(ps), got, aside, 0, len(ps)-got-aside, c.Stats().Undecodable)
	if got != innocent || aside != 2 || c.Stats().Undecodable < 2 {
		t.Fatalf("stored %d of %d innocent, set aside %d of 2, undecodable %d", got, innocent, aside, c.Stats().Undecodable)
	}
}

// TestConsumerSplitsRejectedBatch: the store rejects for good (in batches
// of up to 500, all or nothing) any record of two message ids, one arrival
// and one attempt record. The consumer splits each rejected batch until
// the record is alone and sets it aside; every other record is stored.
func TestConsumerSplitsRejectedBatch(t *testing.T) {
	e := newBrokerEnv(t)
	store := memstore.New()
	badArr, badAtt := e.prefix+"-bad-arrival", e.prefix+"-bad-attempt"
	store.SetReject(func(mid string) bool { return mid == badArr || mid == badAtt })
	c, _ := e.consumer(store, nil)
	var ps []amqp.Publishing
	for i := range 200 {
		if i == 77 {
			ps = append(ps, uuidPublishing(badArr, time.Now()))
		}
		ps = append(ps, uuidPublishing(fmt.Sprintf("%s-%03d", e.prefix, i), time.Now()))
	}
	e.publishRaw(ps...)
	body, err := audit.MarshalAttempt(audit.Attempt{ID: e.prefix + "-att", MessageID: badAtt, Queue: "q", Attempt: 1,
		StartedAt: time.Now(), Outcome: audit.OutcomeSuccess})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.ch.PublishWithContext(context.Background(), e.naming.Exchange, audit.AttemptRoutingKey, true, false,
		amqp.Publishing{Body: body, DeliveryMode: amqp.Persistent, UserId: e.user()}); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 20*time.Second, "every record stored or set aside", func() bool {
		a, _, _, _, _ := store.Counts()
		return a+len(store.SetAsideRecords()) >= len(ps)+1
	})
	a, att, _, _, _ := store.Counts()
	aside := store.SetAsideRecords()
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d",
		t.Name(), len(ps)+1, a+att, len(aside), 0, len(ps)+1-a-att-len(aside))
	kinds := map[string]string{}
	for _, r := range aside {
		kinds[r.MessageID] = r.Kind
		if !strings.Contains(r.Reason, "rejects a record for good") {
			t.Errorf("reason %q", r.Reason)
		}
	}
	if a != len(ps)-1 || att != 0 || len(aside) != 2 || kinds[badArr] != auditconst.KindArrival || kinds[badAtt] != auditconst.KindAttempt ||
		c.Stats().SetAside != 2 {
		t.Fatalf("stored %d arrivals, %d attempts; set aside %+v", a, att, kinds)
	}
}

// TestConsumerSetsAsideUndecodableMessageDefaultLimit: the same with the
// audit queues' own delivery limit (audit.DeliveryLimit, no policy): the
// bad message loops about DeliveryLimit times, one connection each, then
// is set aside; the innocent records are stored meanwhile. Minutes:
// RABBITRETRY_FAULTS=1 only.
func TestConsumerSetsAsideUndecodableMessageDefaultLimit(t *testing.T) {
	if os.Getenv("RABBITRETRY_FAULTS") != "1" {
		t.Skip("a fault run (minutes): set RABBITRETRY_FAULTS=1")
	}
	e := newBrokerEnv(t)
	store := memstore.New()
	deep := amqp.Table{"leaf": int32(1)}
	for range 40 {
		deep = amqp.Table{"n": deep}
	}
	var ps []amqp.Publishing
	for i := range 40 {
		if i == 20 {
			p := uuidPublishing(e.prefix+"-bad", time.Now())
			p.Headers["bad"] = deep
			ps = append(ps, p)
		}
		ps = append(ps, uuidPublishing(fmt.Sprintf("%s-%03d", e.prefix, i), time.Now()))
	}
	c, _ := e.consumer(store, nil)
	start := time.Now()
	e.publishRaw(ps...)
	setAside := func() int { return e.ready(e.naming.WithDefaults().SetAsideQueue) }
	stored := func() int { a, _, _, _, _ := store.Counts(); return a }
	deadline := time.Now().Add(10 * time.Minute)
	for stored()+setAside() < len(ps) && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond) // polling; the deadline decides
	}
	got, aside := stored(), setAside()
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=%d duplicates=%d lost=%d (undecodable connection closes=%d, %v)",
		t.Name(), len(ps), got, aside, 0, len(ps)-got-aside, c.Stats().Undecodable, time.Since(start).Round(time.Second))
	if got != len(ps)-1 || aside != 1 {
		t.Fatalf("stored %d of %d innocent, set aside %d of 1", got, len(ps)-1, aside)
	}
}
