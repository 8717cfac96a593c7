package audit_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// pgStore returns a pgstore.Store on the test PostgreSQL in a schema of
// its own (dropped at the end), and a check function reading every row
// back (duplicates included: grouped by message id, not by record id).
func pgStore(t testing.TB) (*pgstore.Store, func() (map[string][]audit.Arrival, map[string][]audit.Attempt)) {
	t.Helper()
	dsn := testkit.HavePG(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "audit_consumer_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+schema+` CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, func() (map[string][]audit.Arrival, map[string][]audit.Attempt) { return readAll(t, pool, schema) }
}

// readAll reads every arrival and attempt row of schema.
func readAll(t testing.TB, pool *pgxpool.Pool, schema string) (map[string][]audit.Arrival, map[string][]audit.Attempt) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	arr := map[string][]audit.Arrival{}
	rows, err := pool.Query(ctx, `SELECT id, message_id, exchange, routing_key, body, maybe_duplicate FROM `+schema+`.arrivals`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var a audit.Arrival
		if err := rows.Scan(&a.ID, &a.MessageID, &a.Exchange, &a.RoutingKey, &a.Body, &a.MaybeDuplicate); err != nil {
			t.Fatal(err)
		}
		arr[a.MessageID] = append(arr[a.MessageID], a)
	}
	rows.Close()
	att := map[string][]audit.Attempt{}
	rows, err = pool.Query(ctx, `SELECT id, message_id, queue, attempt, outcome, delay_ms, tier_ms, error_class
		FROM `+schema+`.attempts ORDER BY message_id, attempt, started_at`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var a audit.Attempt
		var outcome string
		var delay, tier int64
		if err := rows.Scan(&a.ID, &a.MessageID, &a.Queue, &a.Attempt, &outcome, &delay, &tier, &a.ErrorClass); err != nil {
			t.Fatal(err)
		}
		a.Outcome, a.Delay, a.Tier = audit.Outcome(outcome), time.Duration(delay)*time.Millisecond, time.Duration(tier)*time.Millisecond
		att[a.MessageID] = append(att[a.MessageID], a)
	}
	rows.Close()
	return arr, att
}

func TestStormEndToEndPostgres(t *testing.T) {
	e := newBrokerEnv(t)
	store, check := pgStore(t)
	runStorm(t, e, store, check, 300, nil)
}

// TestConsumerThroughputPostgres measures the Consumer into pgstore with
// Writers 1 and 4 (AUDIT_THROUGHPUT_WRITERS, comma-separated, overrides):
// for each, fresh audit queues are filled first (AUDIT_THROUGHPUT_N
// records, half arrivals of 1 KiB bodies, half attempt records; default
// 10,000), then drained into a fresh schema.
func TestConsumerThroughputPostgres(t *testing.T) {
	n := 10_000
	if v := os.Getenv("AUDIT_THROUGHPUT_N"); v != "" {
		n, _ = strconv.Atoi(v)
	}
	writers := []int{1, 4}
	if v := os.Getenv("AUDIT_THROUGHPUT_WRITERS"); v != "" {
		writers = nil
		for _, f := range strings.Split(v, ",") {
			w, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil {
				t.Fatalf("AUDIT_THROUGHPUT_WRITERS: %v", err)
			}
			writers = append(writers, w)
		}
	}
	rates := map[int]float64{}
	for _, w := range writers {
		t.Run(fmt.Sprintf("writers=%d", w), func(t *testing.T) { rates[w] = consumerThroughput(t, n, w) })
	}
	t.Logf("throughput summary (records/s into pgstore): %v", rates)
}

func consumerThroughput(t *testing.T, n, writers int) float64 {
	e := newBrokerEnv(t)
	store, _ := pgStore(t)
	c, err := audit.NewConsumer(audit.ConsumerConfig{URI: e.uri, Store: store, Naming: e.naming, Writers: writers,
		Exchanges: []audit.Binding{{Exchange: e.exchange, RoutingKey: routingKey}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Declare(); err != nil {
		t.Fatal(err)
	}
	pub, err := confirm.New(confirm.Config{URI: e.uri})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	body := make([]byte, 1024)
	for i := range body {
		body[i] = 'a' + byte(i%26)
	}
	half := n / 2
	const chunk = 500
	for sent := 0; sent < half; sent += chunk {
		var arr, att []amqp.Publishing
		for i := sent; i < min(sent+chunk, half); i++ {
			id := watermill.NewUUID()
			arr = append(arr, amqp.Publishing{Headers: amqp.Table{audit.DefaultUUIDHeader: id, "tenant": "acme"},
				Body: body, DeliveryMode: amqp.Persistent, Timestamp: time.Now(), ContentType: "application/json"})
			b, _ := audit.MarshalAttempt(audit.Attempt{ID: watermill.NewUUID(), MessageID: id, Queue: "orders", Attempt: 1,
				StartedAt: time.Now(), Duration: time.Millisecond, Outcome: audit.OutcomeRetry, Delay: time.Second, Tier: time.Second,
				ErrorClass: "transient", Error: "inventory service unavailable"})
			att = append(att, amqp.Publishing{Body: b, DeliveryMode: amqp.Persistent, ContentType: "application/json", UserId: e.user()})
		}
		if err := pub.PublishRawBatch(context.Background(), e.exchange, routingKey, arr); err != nil {
			t.Fatal(err)
		}
		if err := pub.PublishRawBatch(context.Background(), e.naming.Exchange, audit.AttemptRoutingKey, att); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- c.Run(ctx) }()
	testkit.WaitFor(t, 120*time.Second, fmt.Sprintf("%d records written", 2*half), func() bool {
		st := c.Stats()
		return st.Arrivals+st.Attempts >= uint64(2*half)
	})
	took := time.Since(start)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	st := c.Stats()
	rate := float64(2*half) / took.Seconds()
	t.Logf("throughput: Writers %d: %d records (%d arrivals with 1 KiB bodies, %d attempts) into pgstore in %v: %.0f records/s; %d batches (%.0f records/batch), %d write failures, last Write %v",
		writers, 2*half, st.Arrivals, st.Attempts, took.Round(time.Millisecond), rate, st.Batches,
		float64(2*half)/float64(st.Batches), st.WriteFailures, st.LastWriteLatency.Round(time.Microsecond))
	if st.WriteFailures != 0 {
		t.Errorf("%d write failures (deadlocks between concurrent Writes?)", st.WriteFailures)
	}
	return rate
}

// The same message published twice (a publisher retrying after a lost
// confirm, or two identical publishes within one second) gives two
// identical deliveries, often in one batch: two publishes, two arrival
// records (issue #19 item 6: they collapsed into one), and a redelivery
// of them after a lost connection is written again under the same IDs
// (no third record).
func TestConsumerSamePublishTwicePostgres(t *testing.T) {
	e := newBrokerEnv(t)
	store, check := pgStore(t)
	cons, stop := e.consumer(store, nil)
	p := amqp.Publishing{Headers: amqp.Table{audit.DefaultUUIDHeader: "dup-1"}, Body: []byte("same"), Timestamp: time.Now(), DeliveryMode: amqp.Persistent}
	const n = 3
	for i := 0; i < n; i++ {
		if err := e.ch.PublishWithContext(context.Background(), e.exchange, routingKey, true, false, p); err != nil {
			t.Fatal(err)
		}
	}
	testkit.WaitFor(t, 10*time.Second, "the deliveries written and acked", func() bool {
		return cons.Stats().Arrivals == n && e.ready(e.naming.ArrivalsQueue) == 0
	})
	stop()
	arr, _ := check()
	dups := 0
	for _, a := range arr["dup-1"] {
		if a.MaybeDuplicate {
			dups++
		}
	}
	t.Logf("ACCOUNT TestConsumerSamePublishTwicePostgres: published=%d handled=%d poisoned=0 duplicates=%d lost=%d",
		n, len(arr["dup-1"]), dups+max(0, len(arr["dup-1"])-n), max(0, n-len(arr["dup-1"])))
	if len(arr["dup-1"]) != n {
		t.Fatalf("%d arrival records for one message published %d times, want %d", len(arr["dup-1"]), n, n)
	}
	if st := cons.Stats(); st.WriteFailures != 0 {
		t.Fatalf("%d write failures", st.WriteFailures)
	}
}

// pgCount returns count(*) of a query on the test PostgreSQL.
func pgCount(t testing.TB, query string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgxpool.New(ctx, testkit.HavePG(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var n int
	if err := conn.QueryRow(ctx, query).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Identical publishes (one message published 60 times within a second,
// among 40 others) and a Consumer process that dies between the commit of
// its first batch and the ack: the next Consumer claims the stored
// deliveries' rows in unacked_arrivals (each row once) and stores the
// rest: exactly one arrival per publish, none flagged, and no row left
// once everything is acked (issue #19 item 6). Two Consumers (prefetch 15
// each) take the redeliveries, claiming rows of one fingerprint
// concurrently.
func TestConsumerIdenticalPublishesDieAfterCommitPostgres(t *testing.T) {
	e := newBrokerEnv(t)
	pg, check := pgStore(t)
	store := &commitThenDie{storeLog: joinLog(pg)}
	store.selfOffer = offerOf(store)
	const same, others = 60, 40
	const n = same + others
	p := amqp.Publishing{Headers: amqp.Table{audit.DefaultUUIDHeader: "same-1"}, Body: []byte("same"), Timestamp: time.Now(), DeliveryMode: amqp.Persistent}
	publish := func() {
		ch, err := e.conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		defer ch.Close()
		if err := ch.Confirm(false); err != nil {
			t.Fatal(err)
		}
		var confs []*amqp.DeferredConfirmation
		for i := 0; i < n; i++ {
			q := p
			if i%5 == 2 || i%5 == 4 { // 40 others, interleaved
				q.Headers = amqp.Table{audit.DefaultUUIDHeader: fmt.Sprintf("other-%d", i)}
			}
			c, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), e.exchange, routingKey, true, false, q)
			if err != nil {
				t.Fatal(err)
			}
			confs = append(confs, c)
		}
		for _, c := range confs {
			if !c.Wait() {
				t.Fatal("publish nacked")
			}
		}
	}
	unacked := `SELECT count(*) FROM ` + pg.Schema() + `.unacked_arrivals`
	first := dieAfterCommit(t, e, store, store, n,
		func() int { return pgCount(t, `SELECT count(*) FROM `+pg.Schema()+`.arrivals`) }, publish)
	rowsAfterDeath := pgCount(t, unacked)
	small := func(c *audit.ConsumerConfig) { c.BatchSize, c.Writers = 5, 2 }
	cons1, stop1 := e.consumer(store, small)
	cons2, stop2 := e.consumer(store, small)
	arrivals := `SELECT count(*) FROM ` + pg.Schema() + `.arrivals`
	testkit.WaitFor(t, 20*time.Second, "every publish stored, its row marked acking", func() bool {
		return e.ready(e.naming.ArrivalsQueue) == 0 && pgCount(t, arrivals) >= n && pgCount(t, unacked+` WHERE NOT acking`) == 0
	})
	stop1()
	stop2()
	if r := pgCount(t, unacked); r != 0 {
		t.Errorf("%d unacked-delivery rows left after clean stops", r)
	}
	if r := e.ready(e.naming.ArrivalsQueue); r != 0 {
		t.Errorf("%d deliveries were not acked", r)
	}
	b1, b2 := cons1.Stats().Batches, cons2.Stats().Batches
	arr, _ := check()
	records, flagged, dups, lost := 0, 0, 0, 0
	for id, v := range arr {
		records += len(v)
		want := 1
		if id == "same-1" {
			want = same
		}
		dups += max(0, len(v)-want)
		lost += max(0, want-len(v))
		for _, a := range v {
			if a.MaybeDuplicate {
				flagged++
			}
		}
	}
	lost += others + 1 - len(arr)
	t.Logf("ACCOUNT TestConsumerIdenticalPublishesDieAfterCommitPostgres: published=%d handled=%d poisoned=0 duplicates=%d lost=%d (identical %d; committed before the death %d, unacked rows then %d; flagged maybe_duplicate %d; batches of the two consumers %d, %d)",
		n, records, dups, lost, same, first, rowsAfterDeath, flagged, b1, b2)
	if records != n || dups != 0 || lost != 0 || flagged != 0 || len(arr["same-1"]) != same || rowsAfterDeath != first {
		t.Fatalf("records %d of %d, duplicates %d, lost %d, flagged %d, same-1 %d of %d, rows after the death %d (committed %d)",
			records, n, dups, lost, flagged, len(arr["same-1"]), same, rowsAfterDeath, first)
	}
}
