package audit_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/memstore"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

const routingKey = "order.created"

// brokerEnv is a business exchange and a private audit topology on the
// broker under test, deleted at the end.
type brokerEnv struct {
	t        testing.TB
	uri      string
	prefix   string
	exchange string
	naming   audit.Naming
	conn     *amqp.Connection
	ch       *amqp.Channel
	queues   []string
}

func newBrokerEnv(t testing.TB) *brokerEnv {
	t.Helper()
	uri := testkit.URI(t)
	prefix := testkit.UniqueName(t, "audit")
	e := &brokerEnv{t: t, uri: uri, prefix: prefix, exchange: prefix + ".biz",
		naming: audit.Naming{Exchange: prefix + ".audit", AttemptsQueue: prefix + ".attempts", ArrivalsQueue: prefix + ".arrivals"}}
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	e.conn = conn
	if e.ch, err = conn.Channel(); err != nil {
		t.Fatal(err)
	}
	if err := e.ch.ExchangeDeclare(e.exchange, "direct", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err == nil {
			if err := audit.DeleteTopology(ch, e.naming); err != nil {
				t.Logf("cleanup: %v", err)
			}
			for _, q := range e.queues {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
			_ = ch.ExchangeDelete(e.exchange, false, false)
			_ = ch.Close()
		}
		_ = conn.Close()
	})
	return e
}

// consumer starts an audit Consumer into store; stop cancels it and waits.
func (e *brokerEnv) consumer(store audit.Store, mod func(*audit.ConsumerConfig)) (c *audit.Consumer, stop func()) {
	e.t.Helper()
	cfg := audit.ConsumerConfig{
		URI: e.uri, Store: store, Naming: e.naming, BatchWait: 50 * time.Millisecond,
		Exchanges:    []audit.Binding{{Exchange: e.exchange, RoutingKey: routingKey}},
		WriteBackoff: func() backoff.BackOff { return backoff.NewConstantBackOff(50 * time.Millisecond) },
	}
	if mod != nil {
		mod(&cfg)
	}
	c, err := audit.NewConsumer(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := c.Declare(); err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				e.t.Errorf("Consumer.Run: %v", err)
			}
		})
	}
	e.t.Cleanup(stop)
	return c, stop
}

// publish sends msgs to the business exchange, persistent, with publisher
// confirms.
func (e *brokerEnv) publish(msgs ...*message.Message) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		e.t.Fatal(err)
	}
	m := amqpretry.Marshaler{}
	var confs []*amqp.DeferredConfirmation
	for _, msg := range msgs {
		p, err := m.Marshal(msg)
		if err != nil {
			e.t.Fatal(err)
		}
		p.DeliveryMode = amqp.Persistent
		p.Timestamp = time.Now()
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), e.exchange, routingKey, true, false, p)
		if err != nil {
			e.t.Fatal(err)
		}
		confs = append(confs, dc)
	}
	for _, dc := range confs {
		if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
			e.t.Fatalf("publish not confirmed: %v %v", ok, err)
		}
	}
}

// user is the RabbitMQ user of e's connection: the user-id an attempt
// record needs to be stored (ConsumerConfig.RecorderUsers' default).
func (e *brokerEnv) user() string {
	u, err := amqp.ParseURI(e.uri)
	if err != nil {
		e.t.Fatal(err)
	}
	return u.Username
}

// ready returns the number of ready messages in q.
func (e *brokerEnv) ready(q string) int {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, false, false, false, false, nil)
	if err != nil {
		e.t.Fatalf("inspecting %s: %v", q, err)
	}
	return st.Messages
}

// outcomeOf is what the handler expects of a message: it fails its first
// failures attempts (transient), or every attempt (permanent: poisoned at
// once; drop: dropped).
type plan struct {
	failures  int
	permanent bool
	drop      bool
}

// expected returns the attempt records the chain must produce with
// MaxAttempts max.
func (p plan) expected(max int) []audit.Outcome {
	switch {
	case p.permanent:
		return []audit.Outcome{audit.OutcomePoisoned}
	case p.drop:
		return []audit.Outcome{audit.OutcomeDropped}
	}
	var out []audit.Outcome
	for n := 1; n <= max; n++ {
		if n > p.failures {
			return append(out, audit.OutcomeSuccess)
		}
		if n == max {
			return append(out, audit.OutcomePoisoned)
		}
		out = append(out, audit.OutcomeRetry)
	}
	return out
}

// retryConsumer runs an amqpretry consumer on queue of e's exchange with a
// Recorder wired around the chain; stop closes router, recorder, retry.
func (e *brokerEnv) retryConsumer(queue string, maxAttempts int, h message.NoPublishHandlerFunc) (rec *audit.Recorder, stop func()) {
	e.t.Helper()
	e.queues = append(e.queues, queue)
	subCfg := wamqp.NewDurableQueueConfig(e.uri)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return e.exchange }, Type: "direct", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return routingKey }}
	subCfg.Consume.Qos.PrefetchCount = 64
	var retry *amqpretry.Retry
	rec, err := audit.NewRecorder(audit.RecorderConfig{
		URI: e.uri, Naming: e.naming,
		TierFor: func(_ string, d time.Duration) time.Duration { return retry.Topology().TierFor(d) },
	})
	if err != nil {
		e.t.Fatal(err)
	}
	retry, err = amqpretry.New(amqpretry.Config{
		URI: e.uri, Subscriber: subCfg, QueueType: amqpretry.QueueTypeQuorum, Policy: router.Policy{MaxAttempts: maxAttempts, Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(100 * time.Millisecond) }, Observer: middleware.Observers(rec.Observer())},
		Logger: watermill.NopLogger{},
	})
	if err != nil {
		e.t.Fatal(err)
	}
	e.queues = append(e.queues, append(retry.Topology().WaitQueues(queue), retry.Topology().Naming().PoisonQueue(queue))...)
	sub, err := wamqp.NewSubscriber(retry.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	rt, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		e.t.Fatal(err)
	}
	rt.AddMiddleware(rec.Middleware)
	rt.AddMiddleware(retry.Middleware)
	rt.AddMiddleware(rec.HandlerMiddleware)
	rt.AddConsumerHandler("svc", queue, sub, h)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := rt.Run(ctx); err != nil {
			e.t.Errorf("router: %v", err)
		}
	}()
	select {
	case <-rt.Running():
	case <-time.After(20 * time.Second):
		e.t.Fatal("router did not start")
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			_ = rt.Close()
			cancel()
			<-done
			_ = sub.Close()
			cctx, ccancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer ccancel()
			if err := rec.Close(cctx); err != nil {
				e.t.Errorf("Recorder.Close: %v", err)
			}
			_ = retry.Close()
		})
	}
	e.t.Cleanup(stop)
	return rec, stop
}

// storm publishes n messages with mixed plans through an amqpretry
// consumer with a Recorder, and a Consumer into store, and checks that
// every message has exactly one arrival and the attempts the handler saw.
func runStorm(t *testing.T, e *brokerEnv, store audit.Store, check func() (arrivals map[string][]audit.Arrival, attempts map[string][]audit.Attempt), n int, during func(done func() bool)) {
	const maxAttempts = 3
	rng := rand.New(rand.NewPCG(13, 2))
	plans := map[string]plan{}
	msgs := make([]*message.Message, n)
	wantRecords := 0
	for i := range msgs {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order":%d}`, i)))
		p := plan{failures: rng.IntN(4)}
		switch rng.IntN(20) {
		case 0, 1:
			p = plan{permanent: true}
		case 2:
			p = plan{drop: true}
		}
		plans[m.UUID] = p
		wantRecords += len(p.expected(maxAttempts))
		msgs[i] = m
	}
	var mu sync.Mutex
	seen := map[string][]int{}
	queue := e.prefix + ".svc"
	_, stopRetry := e.retryConsumer(queue, maxAttempts, func(msg *message.Message) error {
		p, ok := plans[msg.UUID]
		if !ok {
			return middleware.Permanent(fmt.Errorf("unknown message %s", msg.UUID))
		}
		n := middleware.Attempt(msg)
		mu.Lock()
		seen[msg.UUID] = append(seen[msg.UUID], n)
		mu.Unlock()
		switch {
		case p.permanent:
			return middleware.Permanent(errors.New("order references unknown customer"))
		case p.drop:
			return middleware.Drop(errors.New("obsolete event"))
		case n <= p.failures:
			return fmt.Errorf("attempt %d: inventory service unavailable", n)
		}
		return nil
	})
	cons, stopCons := e.consumer(store, nil)
	start := time.Now()
	e.publish(msgs...)
	complete := func() bool {
		arr, att := check()
		got := 0
		for _, a := range att {
			got += len(a)
		}
		return len(arr) >= n && got >= wantRecords
	}
	if during != nil {
		during(complete)
	}
	testkit.WaitFor(t, 90*time.Second, fmt.Sprintf("%d arrivals and %d attempt records in the store", n, wantRecords), complete)
	took := time.Since(start)
	stopRetry()
	// Everything the Recorder published is confirmed; wait until the
	// Consumer has written it all, then stop it.
	testkit.WaitFor(t, 30*time.Second, "audit queues drained", func() bool {
		return e.ready(e.naming.AttemptsQueue) == 0 && e.ready(e.naming.ArrivalsQueue) == 0
	})
	stopCons()

	arrivals, attempts := check()
	duplicates, lost, wrong := 0, 0, 0
	handled := 0
	for _, m := range msgs {
		p := plans[m.UUID]
		a := arrivals[m.UUID]
		switch {
		case len(a) == 0:
			lost++
			t.Errorf("%s: no arrival", m.UUID)
		case len(a) > 1:
			duplicates += len(a) - 1
			t.Errorf("%s: %d arrivals", m.UUID, len(a))
		case a[0].Exchange != e.exchange || a[0].RoutingKey != routingKey || string(a[0].Body) != string(m.Payload):
			wrong++
			t.Errorf("%s: arrival %+v", m.UUID, a[0])
		}
		want := p.expected(maxAttempts)
		got := attempts[m.UUID]
		mu.Lock()
		ran := seen[m.UUID]
		mu.Unlock()
		handled += len(ran)
		if len(got) > len(want) {
			duplicates += len(got) - len(want)
		} else if len(got) < len(want) {
			lost += len(want) - len(got)
		}
		if len(got) != len(want) || len(ran) != len(want) {
			t.Errorf("%s (%+v): %d attempt records, handler ran %d times, want %d", m.UUID, p, len(got), len(ran), len(want))
			continue
		}
		for i, w := range want {
			if got[i].Outcome != w || got[i].Attempt != i+1 || ran[i] != i+1 || got[i].Queue != queue {
				wrong++
				t.Errorf("%s attempt %d: outcome %s attempt %d queue %q (handler saw %d), want %s", m.UUID, i+1, got[i].Outcome, got[i].Attempt, got[i].Queue, ran[i], w)
			}
			if w == audit.OutcomeRetry && (got[i].Delay != 100*time.Millisecond || got[i].Tier != 100*time.Millisecond) {
				wrong++
				t.Errorf("%s attempt %d: retry delay %v tier %v", m.UUID, i+1, got[i].Delay, got[i].Tier)
			}
		}
	}
	records := 0
	for _, a := range attempts {
		records += len(a)
	}
	st := cons.Stats()
	t.Logf("accounting: published %d, handled %d, arrivals %d, attempts %d (want %d), duplicates %d, lost %d, wrong %d; %.1fs; consumer: %d batches, %d write failures, %d reconnects",
		n, handled, len(arrivals), records, wantRecords, duplicates, lost, wrong, took.Seconds(), st.Batches, st.WriteFailures, st.Reconnects)
}

func memCheck(s *memstore.Store) func() (map[string][]audit.Arrival, map[string][]audit.Attempt) {
	return func() (map[string][]audit.Arrival, map[string][]audit.Attempt) { return s.Arrivals(), s.Attempts() }
}

func TestStormEndToEnd(t *testing.T) {
	e := newBrokerEnv(t)
	store := memstore.New()
	runStorm(t, e, store, memCheck(store), 300, nil)
}

// While the store is down nothing is acked: the records wait in the audit
// queue; when it is back every record lands exactly once.
func TestConsumerStoreDown(t *testing.T) {
	e := newBrokerEnv(t)
	store := memstore.New()
	store.SetDown(true)
	const n = 200
	cons, stop := e.consumer(store, func(c *audit.ConsumerConfig) { c.BatchSize = 50 })
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
	}
	e.publish(msgs...)
	testkit.WaitFor(t, 10*time.Second, "3 refused writes", func() bool { _, _, _, _, f := store.Counts(); return f >= 3 })
	// The unacked batch plus the prefetched deliveries are out; none is
	// acked, so stopping the consumer puts all n back in the queue.
	stop()
	testkit.WaitFor(t, 10*time.Second, fmt.Sprintf("all %d records back in the arrivals queue", n), func() bool {
		return e.ready(e.naming.ArrivalsQueue) == n
	})
	if st := cons.Stats(); st.Arrivals != 0 || st.WriteFailures < 3 {
		t.Fatalf("consumer stats while down: %+v", st)
	}
	store.SetDown(false)
	cons2, stop2 := e.consumer(store, func(c *audit.ConsumerConfig) { c.BatchSize = 50 })
	testkit.WaitFor(t, 20*time.Second, "all arrivals stored", func() bool { a, _, _, _, _ := store.Counts(); return a == n })
	testkit.WaitFor(t, 10*time.Second, "arrivals queue empty", func() bool { return e.ready(e.naming.ArrivalsQueue) == 0 })
	stop2()
	arr := store.Arrivals()
	dups, lost := 0, 0
	for _, m := range msgs {
		switch len(arr[m.UUID]) {
		case 0:
			lost++
		case 1:
		default:
			dups += len(arr[m.UUID]) - 1
		}
	}
	a, _, rewrites, writes, failed := store.Counts()
	st1, st2 := cons.Stats(), cons2.Stats()
	t.Logf("accounting: published %d, arrivals %d, duplicates %d, lost %d; refused writes %d, writes %d, rewrites %d; last write %v",
		n, a, dups, lost, failed, writes, rewrites, st2.LastWriteLatency)
	if dups != 0 || lost != 0 || st1.WriteFailures == 0 {
		t.Fatalf("duplicates %d, lost %d", dups, lost)
	}
}

// commitThenDie commits a Write, then "dies" before the Consumer can ack:
// it cancels the Consumer's Run and reports a failure (the commit
// acknowledgement lost on the way back).
type commitThenDie struct {
	storeLog
	selfOffer // of itself: the log of every call
	once      sync.Once
	cancel    atomic.Pointer[func()]
	died      atomic.Bool
}

func (s *commitThenDie) die() error {
	died := false
	s.once.Do(func() {
		(*s.cancel.Load())()
		died = true
	})
	if died {
		s.died.Store(true)
		return errors.New("connection to the store lost after commit")
	}
	return nil
}

func (s *commitThenDie) Write(ctx context.Context, arr []audit.Arrival, att []audit.Attempt) error {
	if err := s.storeLog.Write(ctx, arr, att); err != nil {
		return err
	}
	return s.die()
}

func (s *commitThenDie) WriteDeliveries(ctx context.Context, arr []audit.Arrival, att []audit.Attempt, d []unackedDelivery) error {
	if err := s.storeLog.WriteDeliveries(ctx, arr, att, d); err != nil {
		return err
	}
	return s.die()
}

// plainStore hides a Store's delivery log.
type plainStore struct{ audit.Store }

// dieAfterCommit runs a Consumer (BatchSize 40) into store until its
// first Write has committed, then makes it die before any ack; every
// delivery is back in the queue. It returns the number of arrivals
// committed before the death (count reads the store).
func dieAfterCommit(t *testing.T, e *brokerEnv, store audit.Store, cd *commitThenDie, n int, count func() int, publish func()) (first int) {
	t.Helper()
	cfg := audit.ConsumerConfig{
		URI: e.uri, Store: store, Naming: e.naming, BatchSize: 40, BatchWait: 50 * time.Millisecond,
		Exchanges: []audit.Binding{{Exchange: e.exchange, RoutingKey: routingKey}},
	}
	c, err := audit.NewConsumer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Declare(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancelFn := func() { cancel() }
	cd.cancel.Store(&cancelFn)
	publish()
	if err := c.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if !cd.died.Load() {
		t.Fatal("the store never died")
	}
	if first = count(); first == 0 {
		t.Fatal("nothing committed before the death")
	}
	// Nothing was acked: every record is back in the queue.
	testkit.WaitFor(t, 10*time.Second, "all records back in the queue", func() bool { return e.ready(e.naming.ArrivalsQueue) == n })
	return first
}

func distinctMessages(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
	}
	return msgs
}

// A batch committed but not acked (the consumer process died in between)
// is redelivered to the next consumer process, which finds the deliveries
// that were stored in the store's delivery log (rows written with the
// batch, of a session whose exclusive queue is gone) and does not store
// them again: every message stored exactly once (issue #19 item 6), and
// the delivery log empty once everything is acked.
func TestConsumerDiesAfterCommit(t *testing.T) {
	e := newBrokerEnv(t)
	mem := memstore.New()
	store := &commitThenDie{storeLog: joinLog(mem)}
	store.selfOffer = offerOf(store)
	const n = 100
	msgs := distinctMessages(n)
	first := dieAfterCommit(t, e, store, store, n,
		func() int { a, _, _, _, _ := mem.Counts(); return a }, func() { e.publish(msgs...) })
	cons, stop := e.consumer(store, nil)
	testkit.WaitFor(t, 20*time.Second, "all messages stored", func() bool { return len(mem.Arrivals()) == n })
	testkit.WaitFor(t, 10*time.Second, "arrivals queue empty", func() bool { return e.ready(e.naming.ArrivalsQueue) == 0 })
	testkit.WaitFor(t, 10*time.Second, "every unacked-delivery row marked acking", func() bool { u, _ := mem.Unacked(); return u == 0 })
	stop()
	if u, acking := mem.Unacked(); u+acking != 0 {
		t.Errorf("%d unacked-delivery rows left after a clean stop (%d acking)", u+acking, acking)
	}
	a, _, _, _, _ := mem.Counts()
	arr := mem.Arrivals()
	dups, flagged := 0, 0
	for _, v := range arr {
		dups += len(v) - 1
		for _, r := range v {
			if r.MaybeDuplicate {
				flagged++
			}
		}
	}
	t.Logf("ACCOUNT TestConsumerDiesAfterCommit: published=%d handled=%d poisoned=0 duplicates=%d lost=%d (committed before the death %d; redelivered records stored %d, flagged maybe_duplicate %d)",
		n, a, dups, n-len(arr), first, cons.Stats().Arrivals, flagged)
	if dups != 0 || len(arr) != n || a != n || flagged != 0 {
		t.Fatalf("duplicates %d, messages %d of %d, records %d, flagged %d", dups, len(arr), n, a, flagged)
	}
}

// Without a delivery log (a Store that only writes), the next consumer
// process cannot tell which redeliveries were stored: every message is
// stored, none lost or merged, and a second record of one is flagged
// MaybeDuplicate (never an unflagged duplicate).
func TestConsumerDiesAfterCommitPlainStore(t *testing.T) {
	e := newBrokerEnv(t)
	mem := memstore.New()
	cd := &commitThenDie{storeLog: joinLog(mem)}
	cd.selfOffer = offerOf(cd)
	store := plainStore{cd}
	const n = 100
	msgs := distinctMessages(n)
	first := dieAfterCommit(t, e, store, cd, n,
		func() int { a, _, _, _, _ := mem.Counts(); return a }, func() { e.publish(msgs...) })
	_, stop := e.consumer(store, nil)
	testkit.WaitFor(t, 20*time.Second, "all messages stored", func() bool { return len(mem.Arrivals()) == n })
	testkit.WaitFor(t, 10*time.Second, "arrivals queue empty", func() bool { return e.ready(e.naming.ArrivalsQueue) == 0 })
	stop()
	a, _, _, _, _ := mem.Counts()
	arr := mem.Arrivals()
	flaggedDups, unflaggedDups := 0, 0
	for id, v := range arr {
		plain := 0
		for _, r := range v {
			if !r.MaybeDuplicate {
				plain++
			}
		}
		if plain > 1 || len(v) > 2 {
			unflaggedDups += len(v) - 1
			t.Errorf("%s: %d records, %d not flagged MaybeDuplicate", id, len(v), plain)
		} else {
			flaggedDups += len(v) - 1
		}
	}
	t.Logf("ACCOUNT TestConsumerDiesAfterCommitPlainStore: published=%d handled=%d poisoned=0 duplicates=%d lost=%d (committed before the death %d; duplicates all flagged maybe_duplicate)",
		n, a, flaggedDups+unflaggedDups, n-len(arr), first)
	if unflaggedDups != 0 || len(arr) != n || flaggedDups > first {
		t.Fatalf("unflagged duplicates %d, messages %d of %d, flagged duplicates %d (at most %d committed before the death)", unflaggedDups, len(arr), n, flaggedDups, first)
	}
}

// A malformed attempt record is counted, acked and does not hold up the
// records behind it.
func TestConsumerMalformedAttempt(t *testing.T) {
	e := newBrokerEnv(t)
	store := memstore.New()
	cons, stop := e.consumer(store, nil)
	good := audit.Attempt{ID: watermill.NewUUID(), MessageID: "m1", Queue: "q", Attempt: 1, Outcome: audit.OutcomeSuccess, StartedAt: time.Now()}
	body, _ := audit.MarshalAttempt(good)
	for _, b := range [][]byte{[]byte("{not json"), []byte(`{"outcome":"success"}`), body} {
		if err := e.ch.PublishWithContext(context.Background(), e.naming.Exchange, audit.AttemptRoutingKey, true, false,
			amqp.Publishing{Body: b, DeliveryMode: amqp.Persistent, UserId: e.user()}); err != nil {
			t.Fatal(err)
		}
	}
	testkit.WaitFor(t, 10*time.Second, "the good record stored", func() bool { _, n, _, _, _ := store.Counts(); return n == 1 })
	testkit.WaitFor(t, 10*time.Second, "attempts queue empty", func() bool { return e.ready(e.naming.AttemptsQueue) == 0 })
	stop()
	if st := cons.Stats(); st.Malformed != 2 || st.Attempts != 1 {
		t.Fatalf("stats %+v, want 2 malformed, 1 attempt", st)
	}
	if e.ready(e.naming.AttemptsQueue) != 0 {
		t.Fatal("malformed records left in the queue")
	}
}

func TestConsumerMissingExchange(t *testing.T) {
	e := newBrokerEnv(t)
	c, err := audit.NewConsumer(audit.ConsumerConfig{URI: e.uri, Store: memstore.New(), Naming: e.naming,
		Exchanges: []audit.Binding{{Exchange: e.prefix + ".nope"}}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.Run(ctx); !errors.Is(err, audit.ErrExchangeNotFound) {
		t.Fatalf("Run: %v, want ErrExchangeNotFound", err)
	}
}

func TestConsumerConfigValidate(t *testing.T) {
	store := memstore.New()
	for _, c := range []struct {
		cfg  audit.ConsumerConfig
		want string
	}{
		{audit.ConsumerConfig{Store: store}, "URI is empty"},
		{audit.ConsumerConfig{URI: "http://x", Store: store}, "URI is invalid"},
		{audit.ConsumerConfig{URI: "amqp://x/"}, "Store is nil"},
		{audit.ConsumerConfig{URI: "amqp://x/", Store: store, Exchanges: []audit.Binding{{}}}, "Exchanges[0].Exchange is empty"},
		{audit.ConsumerConfig{URI: "amqp://x/", Store: store, BatchSize: -1}, "BatchSize -1"},
		{audit.ConsumerConfig{URI: "amqp://x/", Store: store, Writers: -1}, "Writers -1"},
		{audit.ConsumerConfig{URI: "amqp://x/", Store: store, Writers: 8, BatchSize: 8000}, "(Writers+1)×BatchSize = 72000"},
		{audit.ConsumerConfig{URI: "amqp://x/", Store: store, QueueType: "stream"}, "QueueType \"stream\""},
		{audit.ConsumerConfig{URI: "amqp://x/", Store: store, RecorderUsers: []string{"svc", ""}}, "RecorderUsers[1] is empty"},
	} {
		_, err := audit.NewConsumer(c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %v, want one containing %q", c.cfg, err, c.want)
		}
	}
}

// gateStore holds its first Write until released, then commits it.
type gateStore struct {
	audit.Store
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (s *gateStore) Write(ctx context.Context, arr []audit.Arrival, att []audit.Attempt) error {
	first := false
	s.once.Do(func() {
		close(s.entered)
		<-s.release
		first = true
	})
	if first {
		// The commit completes although the consumer has gone meanwhile
		// (it was already on its way in PostgreSQL).
		ctx = context.WithoutCancel(ctx)
	}
	return s.Store.Write(ctx, arr, att)
}

// The connection dies (its socket closed) while a batch is being
// written: the batch commits but cannot be acked; the broker requeues it,
// the Consumer reconnects, and the redelivered records are written again
// without duplicates.
// gateLog is gateStore for a delivery log: its first WriteDeliveries is
// held until released, then commits.
type gateLog struct {
	storeLog
	selfOffer // of itself: the log of every call
	gate      *gateStore
}

func (s *gateLog) WriteDeliveries(ctx context.Context, arr []audit.Arrival, att []audit.Attempt, d []unackedDelivery) error {
	first := false
	s.gate.once.Do(func() {
		close(s.gate.entered)
		<-s.gate.release
		first = true
	})
	if first {
		ctx = context.WithoutCancel(ctx)
	}
	return s.storeLog.WriteDeliveries(ctx, arr, att, d)
}

func TestConsumerConnectionLostMidBatch(t *testing.T) { connectionLostMidBatch(t, false) }

// The same with the store's delivery log: the redeliveries of the batch
// that committed after the connection was lost claim its rows (the
// ended session's) and are not written again.
func TestConsumerConnectionLostMidBatchDeliveryLog(t *testing.T) { connectionLostMidBatch(t, true) }

func connectionLostMidBatch(t *testing.T, withLog bool) {
	e := newBrokerEnv(t)
	mem := memstore.New()
	gate := &gateStore{Store: plainStore{mem}, entered: make(chan struct{}), release: make(chan struct{})}
	var store audit.Store = gate
	if withLog {
		gl := &gateLog{storeLog: joinLog(mem), gate: gate}
		gl.selfOffer = offerOf(gl)
		store = gl
	}
	var mu sync.Mutex
	var sockets []net.Conn
	dial := func(network, addr string) (net.Conn, error) {
		c, err := net.DialTimeout(network, addr, 10*time.Second)
		if err == nil {
			mu.Lock()
			sockets = append(sockets, c)
			mu.Unlock()
		}
		return c, err
	}
	const n = 100
	cons, stop := e.consumer(store, func(c *audit.ConsumerConfig) {
		c.BatchSize = 40
		c.AmqpConfig = &amqp.Config{Dial: dial}
		c.ReconnectBackoff = func() backoff.BackOff { return backoff.NewConstantBackOff(50 * time.Millisecond) }
	})
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
	}
	e.publish(msgs...)
	testkit.Recv(t, gate.entered, 10*time.Second)
	mu.Lock()
	_ = sockets[len(sockets)-1].Close() // the session's connection
	mu.Unlock()
	close(gate.release)
	testkit.WaitFor(t, 20*time.Second, "all messages stored", func() bool { return len(mem.Arrivals()) == n })
	testkit.WaitFor(t, 10*time.Second, "arrivals queue empty", func() bool { return e.ready(e.naming.ArrivalsQueue) == 0 })
	if withLog {
		testkit.WaitFor(t, 10*time.Second, "every unacked-delivery row marked acking", func() bool { u, _ := mem.Unacked(); return u == 0 })
	}
	stop()
	if u, acking := mem.Unacked(); withLog && u+acking != 0 {
		t.Errorf("%d unacked-delivery rows left after a clean stop (%d acking)", u+acking, acking)
	}
	a, _, rewrites, _, _ := mem.Counts()
	dups := 0
	for _, v := range mem.Arrivals() {
		dups += len(v) - 1
	}
	st := cons.Stats()
	t.Logf("accounting: published %d, arrivals %d, rewritten on redelivery %d, duplicates %d, lost %d; reconnects %d, arrivals written %d (delivery log %v)",
		n, a, rewrites, dups, n-a, st.Reconnects, st.Arrivals, withLog)
	if withLog {
		// Claimed redeliveries are not written again: n arrivals written in all.
		if st.Reconnects < 1 || rewrites != 0 || st.Arrivals != n || dups != 0 || a != n {
			t.Fatalf("reconnects %d, rewrites %d, arrivals written %d, duplicates %d, arrivals %d", st.Reconnects, rewrites, st.Arrivals, dups, a)
		}
		return
	}
	if st.Reconnects < 1 || rewrites < 1 || dups != 0 || a != n {
		t.Fatalf("reconnects %d, rewrites %d, duplicates %d, arrivals %d", st.Reconnects, rewrites, dups, a)
	}
}

// holdFirstBatch holds the Write of the batch carrying the arrival of
// message first until released, then fails it (the commit never
// happened); every other Write commits at once, so later batches commit
// before the first one.
type holdFirstBatch struct {
	*memstore.Store
	first   string
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (s *holdFirstBatch) Write(ctx context.Context, arr []audit.Arrival, att []audit.Attempt) error {
	for _, a := range arr {
		if a.MessageID != s.first {
			continue
		}
		held := false
		s.once.Do(func() {
			close(s.entered)
			<-s.release
			held = true
		})
		if held {
			return errors.New("store connection lost before commit")
		}
	}
	return s.Store.Write(ctx, arr, att)
}

// With Writers 4, batches commit out of order: the first batch is held
// while the four after it commit. None of them may be acked (a multiple
// ack of a later batch would cover the first one's deliveries): when the
// connection dies then, the broker redelivers all of them, and the first
// batch's records land after the reconnect.
func TestConsumerWritersAckInBatchOrder(t *testing.T) {
	e := newBrokerEnv(t)
	const n, batchSize = 200, 40
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
	}
	mem := memstore.New()
	store := &holdFirstBatch{Store: mem, first: msgs[0].UUID, entered: make(chan struct{}), release: make(chan struct{})}
	var mu sync.Mutex
	var sockets []net.Conn
	dial := func(network, addr string) (net.Conn, error) {
		c, err := net.DialTimeout(network, addr, 10*time.Second)
		if err == nil {
			mu.Lock()
			sockets = append(sockets, c)
			mu.Unlock()
		}
		return c, err
	}
	// Without its delivery log, redeliveries are rewritten (counted).
	cons, stop := e.consumer(plainStore{store}, func(c *audit.ConsumerConfig) {
		c.BatchSize, c.Writers = batchSize, 4
		c.AmqpConfig = &amqp.Config{Dial: dial}
		c.ReconnectBackoff = func() backoff.BackOff { return backoff.NewConstantBackOff(50 * time.Millisecond) }
	})
	e.publish(msgs...)
	testkit.Recv(t, store.entered, 10*time.Second)
	// The first batch is held; the other four commit meanwhile (the
	// prefetch of (4+1)×40 lets all 200 deliveries out).
	testkit.WaitFor(t, 10*time.Second, "the 4 later batches committed", func() bool {
		a, _, _, w, _ := mem.Counts()
		return w == 4 && a == n-batchSize
	})
	committedLater, _, _, _, _ := mem.Counts()
	mu.Lock()
	_ = sockets[len(sockets)-1].Close() // the session's connection
	mu.Unlock()
	close(store.release)
	testkit.WaitFor(t, 20*time.Second, "all messages stored", func() bool { return len(mem.Arrivals()) == n })
	// The first batch's records complete the arrivals as soon as they are
	// written; the later batches' redeliveries may still be in flight
	// (delivered, not yet rewritten: not "ready" in the queue). Had they
	// been acked before the first batch committed, they would never come
	// back and this wait would time out.
	testkit.WaitFor(t, 20*time.Second, "the later batches redelivered and rewritten", func() bool {
		_, _, rw, _, _ := mem.Counts()
		return rw >= committedLater
	})
	testkit.WaitFor(t, 10*time.Second, "arrivals queue empty", func() bool { return e.ready(e.naming.ArrivalsQueue) == 0 })
	stop()
	a, _, rewrites, _, _ := mem.Counts()
	arr := mem.Arrivals()
	dups, lost := 0, 0
	for _, m := range msgs {
		switch len(arr[m.UUID]) {
		case 0:
			lost++
		case 1:
		default:
			dups += len(arr[m.UUID]) - 1
		}
	}
	st := cons.Stats()
	t.Logf("accounting: published %d, committed before the first batch %d, arrivals %d, rewritten on redelivery %d, duplicates %d, lost %d; reconnects %d",
		n, committedLater, a, rewrites, dups, lost, st.Reconnects)
	// Every record of the later batches was redelivered (not acked).
	if st.Reconnects < 1 || rewrites != committedLater || dups != 0 || lost != 0 {
		t.Fatalf("reconnects %d, rewrites %d (want %d), duplicates %d, lost %d", st.Reconnects, rewrites, committedLater, dups, lost)
	}
}
