package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/router"
)

// auditRuns is how many drains each variant (without / with audit) runs,
// interleaved; medians are reported.
const auditRuns = 3

// auditBatch is the audit Consumer's BatchSize in the bench.
var auditBatch = auditconst.BatchSize

var auditQueueType = amqpretry.QueueTypeQuorum

type auditRun struct {
	Audit  bool    `json:"audit"`
	Rate   float64 `json:"msg_per_s"`
	P50Us  float64 `json:"handler_p50_us"`
	P99Us  float64 `json:"handler_p99_us"`
	MaxUs  float64 `json:"handler_max_us"`
	Drains int     `json:"messages"`
}

type auditResult struct {
	Messages int        `json:"messages_per_run"`
	Runs     []auditRun `json:"runs"`
	// Medians over the runs of each variant.
	BareP99Us, AuditP99Us   float64 `json:"-"`
	BareP50Us, AuditP50Us   float64 `json:"-"`
	BareRate, AuditRate     float64 `json:"-"`
	StoreRecords            int     `json:"store_records"`
	StoreRecordsPerS        float64 `json:"store_records_per_s"`
	StoreMessagesPerS       float64 `json:"store_messages_per_s"`
	RecorderPublished       uint64  `json:"recorder_published"`
	AuditP99Delta           float64 `json:"audit_p99_delta_us"`
	ConsumerBatches         uint64  `json:"consumer_batches"`
	ConsumerWriteFailures   uint64  `json:"consumer_write_failures"`
	ConsumerLastWriteMs     float64 `json:"consumer_last_write_ms"`
	PostgreSQL              string  `json:"postgresql_dsn"`
	StoreKeepsUpWithDrainAt float64 `json:"store_vs_drain_ratio"`
}

// scenarioAudit: the cost of the audit on a handler, and the audit
// consumer's throughput into PostgreSQL.
//
// Part 1: a queue bound to a business exchange is drained (prefetch 256,
// no-op handler, every message succeeds) with the retry chain alone and
// with the audit (Recorder outside and inside the chain, Observer, and the
// audit Consumer writing into PostgreSQL at the same time), auditRuns runs
// each, interleaved; the handler latency is measured by an outermost
// middleware around everything the message goes through in the process
// (p50/p99/max per run, medians reported), with the drain rate.
//
// Part 2: the audit Consumer is stopped, the audit queues are loaded with
// n arrivals (published to the business exchange) and n attempt records,
// and the Consumer is started: records/s into the store from its first to
// its last write, against the no-failure drain rate of part 1 (each
// message makes two records: its arrival and its attempt).
func (b *bench) scenarioAudit() (err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	n := b.size("audit", 10000)
	dsn := envOr("RABBITRETRY_PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	ctx := context.Background()
	schema := "bench_audit_" + watermill.NewShortUUID()[:8]
	store, err := pgstore.New(ctx, pgstore.Config{DSN: dsn, Schema: schema})
	if err != nil {
		return fmt.Errorf("audit store (scripts/ensure-postgres.sh): %w", err)
	}
	defer func() {
		_, _ = store.Pool().Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
		store.Close()
	}()
	res := &auditResult{Messages: n, PostgreSQL: redactDSN(dsn)}
	b.summary.Audit = res

	exchange := e.name("audit", "orders")
	q := e.name("audit", "q")
	naming := audit.Naming{Exchange: e.name("audit", "x"), AttemptsQueue: e.name("audit", "attempts"), ArrivalsQueue: e.name("audit", "arrivals")}
	e.trackExchanges(exchange, naming.Exchange)
	e.trackQueues(naming.AttemptsQueue, naming.ArrivalsQueue)
	ch, err := e.channel()
	if err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(exchange, "topic", true, false, false, false, nil); err != nil {
		return err
	}
	_ = ch.Close()

	consumer, err := audit.NewConsumer(audit.ConsumerConfig{URI: e.uri, Store: store, Naming: naming,
		Exchanges: []audit.Binding{{Exchange: exchange}}, Logger: e.logger, BatchSize: auditBatch, QueueType: auditQueueType})
	if err != nil {
		return err
	}
	if err := consumer.Declare(); err != nil {
		return err
	}
	startConsumer := func() (stop func()) {
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { _ = consumer.Run(cctx); close(done) }()
		return func() { cancel(); <-done }
	}

	subCfg := wamqp.NewDurableQueueConfig(e.uri)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return exchange }, Type: "topic", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "order.created" }}
	subCfg.Consume.Qos.PrefetchCount = 256
	rec, err := audit.NewRecorder(audit.RecorderConfig{URI: e.uri, Naming: naming, Logger: e.logger, QueueType: auditQueueType,
		QueueName: func(ctx context.Context) string { return message.SubscribeTopicFromCtx(ctx) }})
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = rec.Close(cctx)
	}()
	retry, _, closeAll, err := e.retryConsumer(amqpretry.Config{Subscriber: subCfg, Naming: e.naming("audit"), Logger: e.logger, Policy: router.Policy{Observer: rec.Observer()}}, q)
	if err != nil {
		return err
	}
	defer closeAll()

	e.mu.Lock()
	conn := e.admin
	e.mu.Unlock()
	for r := range auditRuns * 2 {
		withAudit := (r%2 == 1) != (r/2%2 == 1) // bare, audit, audit, bare, bare, audit
		var stop func()
		if withAudit {
			stop = startConsumer()
		}
		// The router closes its subscriber: one per run.
		sub, err := wamqp.NewSubscriber(retry.SubscriberConfig(), e.logger)
		if err != nil {
			return err
		}
		run, err := e.auditDrain(conn, exchange, q, n, sub, retry, rec, withAudit)
		if stop != nil {
			stop()
		}
		if err != nil {
			return err
		}
		res.Runs = append(res.Runs, run)
		logf("audit run %d audit=%v: %.0f msg/s, handler p50 %.0f us, p99 %.0f us, max %.0f us", r+1, withAudit, run.Rate, run.P50Us, run.P99Us, run.MaxUs)
	}
	med := func(audited bool, f func(auditRun) float64) float64 {
		var xs []float64
		for _, r := range res.Runs {
			if r.Audit == audited {
				xs = append(xs, f(r))
			}
		}
		return median(xs)
	}
	res.BareP50Us, res.AuditP50Us = med(false, func(r auditRun) float64 { return r.P50Us }), med(true, func(r auditRun) float64 { return r.P50Us })
	res.BareP99Us, res.AuditP99Us = med(false, func(r auditRun) float64 { return r.P99Us }), med(true, func(r auditRun) float64 { return r.P99Us })
	res.BareRate, res.AuditRate = med(false, func(r auditRun) float64 { return r.Rate }), med(true, func(r auditRun) float64 { return r.Rate })
	res.AuditP99Delta = res.AuditP99Us - res.BareP99Us

	// Part 2: drain what is left into the store, then load a fresh n + n.
	stop := startConsumer()
	if err := waitUntil(5*time.Minute, "audit consumer catching up", func() (bool, error) {
		st, err := store.Stats(ctx)
		return st.Arrivals >= int64(2*auditRuns*n) && st.Attempts >= int64(auditRuns*n), err
	}); err != nil {
		stop()
		return err
	}
	stop()
	res.RecorderPublished = rec.Stats().Published
	if _, err := fill(conn, exchange, "order.created.unbound", n, func(i int) amqp.Publishing { return benchPublishing(i, nil) }); err != nil {
		return err
	}
	now := time.Now()
	u, err := amqp.ParseURI(e.uri)
	if err != nil {
		return err
	}
	recorderUser := u.Username
	if _, err := fill(conn, naming.Exchange, auditconst.AttemptRoutingKey, n, func(i int) amqp.Publishing {
		body, _ := json.Marshal(audit.Attempt{ID: watermill.NewUUID(), MessageID: watermill.NewUUID(), Queue: q,
			Attempt: 1, StartedAt: now, Duration: 20 * time.Microsecond, Outcome: audit.OutcomeSuccess})
		// The Recorder's validated user-id: the Consumer stores only its RecorderUsers' records.
		return amqp.Publishing{DeliveryMode: amqp.Persistent, ContentType: "application/json", Body: body, UserId: recorderUser}
	}); err != nil {
		return err
	}
	before, err := store.Stats(ctx)
	if err != nil {
		return err
	}
	want := before.Arrivals + before.Attempts + int64(2*n)
	start := time.Now()
	stop = startConsumer()
	err = waitUntil(5*time.Minute, "audit consumer writing the loaded records", func() (bool, error) {
		st, err := store.Stats(ctx)
		return st.Arrivals+st.Attempts >= want, err
	})
	took := time.Since(start)
	stop()
	if err != nil {
		return err
	}
	cs := consumer.Stats()
	res.StoreRecords = 2 * n
	res.StoreRecordsPerS = float64(2*n) / took.Seconds()
	res.StoreMessagesPerS = res.StoreRecordsPerS / 2
	res.ConsumerBatches, res.ConsumerWriteFailures = cs.Batches, cs.WriteFailures
	res.ConsumerLastWriteMs = float64(cs.LastWriteLatency.Microseconds()) / 1000
	res.StoreKeepsUpWithDrainAt = res.StoreMessagesPerS / res.BareRate
	logf("audit consumer: %d records into PostgreSQL in %.2fs: %.0f records/s (%.0f messages/s), last batch write %.1f ms",
		2*n, took.Seconds(), res.StoreRecordsPerS, res.StoreMessagesPerS, res.ConsumerLastWriteMs)

	b.row("8 audit", fmt.Sprintf("handler p50 / p99 without audit (median of %d runs of %d; prefetch 256)", auditRuns, n),
		fmt.Sprintf("%.0f / %.0f us", res.BareP50Us, res.BareP99Us), "", "")
	b.row("8 audit", "handler p50 / p99 with audit (Recorder + Consumer into PostgreSQL running)",
		fmt.Sprintf("%.0f / %.0f us", res.AuditP50Us, res.AuditP99Us), "", "")
	b.row("8 audit", "p99 added by the audit", fmt.Sprintf("%+.0f us", res.AuditP99Delta), "< 100 us", passMiss(res.AuditP99Delta < 100))
	b.row("8 audit", "drain rate without / with audit", fmt.Sprintf("%s / %s", fmtRate(res.BareRate), fmtRate(res.AuditRate)), "", "")
	b.row("8 audit", fmt.Sprintf("audit consumer into PostgreSQL (%d arrivals + %d attempts, batches of %d)", n, n, auditconst.BatchSize),
		fmt.Sprintf("%.0f records/s = %.0f msg/s", res.StoreRecordsPerS, res.StoreMessagesPerS), ">= drain rate", passMiss(res.StoreMessagesPerS >= res.BareRate))
	return nil
}

// auditDrain publishes n messages to exchange (bound to q) and drains them
// through the retry chain, with or without the audit middlewares, timing
// each message from the outermost middleware in and out.
func (e *env) auditDrain(conn *amqp.Connection, exchange, q string, n int, sub message.Subscriber, retry *amqpretry.Retry, rec *audit.Recorder, withAudit bool) (auditRun, error) {
	run := auditRun{Audit: withAudit, Drains: n}
	if _, err := fill(conn, exchange, "order.created", n, func(i int) amqp.Publishing { return benchPublishing(i, nil) }); err != nil {
		return run, err
	}
	var mu sync.Mutex
	lat := make([]time.Duration, 0, n)
	t := newTracker(n)
	timing := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			start := time.Now()
			out, err := h(msg)
			d := time.Since(start)
			mu.Lock()
			lat = append(lat, d)
			mu.Unlock()
			return out, err
		}
	}
	mws := []message.HandlerMiddleware{timing}
	if withAudit {
		mws = append(mws, rec.Middleware, retry.Middleware, rec.HandlerMiddleware)
	} else {
		mws = append(mws, retry.Middleware)
	}
	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: 1, middlewares: mws,
		handler: func(*message.Message) error { t.hit(); return nil }})
	if err != nil {
		return run, err
	}
	werr := t.wait(5*time.Minute, "audit drain")
	cerr := rr.close()
	if werr != nil || cerr != nil {
		return run, errors.Join(werr, cerr)
	}
	mu.Lock()
	slices.Sort(lat)
	run.P50Us = float64(percentile(lat, 50).Nanoseconds()) / 1000
	run.P99Us = float64(percentile(lat, 99).Nanoseconds()) / 1000
	run.MaxUs = float64(lat[len(lat)-1].Nanoseconds()) / 1000
	mu.Unlock()
	run.Rate = t.rate()
	return run, nil
}

// waitUntil polls cond every 100 ms until it holds or timeout passes.
func waitUntil(timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: not within %s", what, timeout)
		}
		time.Sleep(100 * time.Millisecond) // polling interval
	}
}

// redactDSN hides a URL DSN's password.
func redactDSN(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && u.User != nil {
		return u.Redacted()
	}
	return dsn
}
