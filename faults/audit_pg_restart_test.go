package faults

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

const pgBin = "/usr/lib/postgresql/15/bin"

// privatePG is a throwaway PostgreSQL 15 cluster in a temp dir, owned by
// the postgres user, on a free port; stopped and removed at the end.
type privatePG struct {
	t    testing.TB
	dir  string
	data string
	port int
}

func (p *privatePG) ctl(args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", filepath.Join(pgBin, "pg_ctl"), "-D", p.data}, args...)...)
	cmd.WaitDelay = 5 * time.Second // a postmaster holding the output pipe cannot hang the test
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("pg_ctl %v: %w: %s", args, err, out)
	}
	return nil
}

func startPrivatePG(t testing.TB) *privatePG {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run PostgreSQL as the postgres user")
	}
	if _, err := os.Stat(filepath.Join(pgBin, "initdb")); err != nil {
		t.Skipf("PostgreSQL 15 binaries not found: %v", err)
	}
	dir, err := os.MkdirTemp("", "rabbitretry-pg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if out, err := exec.Command("chown", "postgres", dir).CombinedOutput(); err != nil {
		t.Fatalf("chown: %v: %s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	p := &privatePG{t: t, dir: dir, data: filepath.Join(dir, "data"), port: port}
	initdb := exec.Command("runuser", "-u", "postgres", "--", filepath.Join(pgBin, "initdb"), "-D", p.data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v: %s", err, out)
	}
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=on", port, dir)
	if err := p.ctl("-l", filepath.Join(dir, "log"), "-o", opts, "-w", "-t", "60", "start"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.ctl("-m", "immediate", "-w", "stop"); err != nil {
			t.Logf("stopping the private PostgreSQL: %v", err)
		}
	})
	return p
}

func (p *privatePG) dsn() string {
	return "postgres://postgres@127.0.0.1:" + strconv.Itoa(p.port) + "/postgres?sslmode=disable"
}

// restart stops PostgreSQL with -m fast (open transactions rolled back,
// connections cut) and starts it again, waiting for both.
// The log file must be named again: without it the new postmaster would
// write to (and hold open) pg_ctl's output pipe.
func (p *privatePG) restart() error {
	return p.ctl("-l", filepath.Join(p.dir, "log"), "-m", "fast", "-w", "-t", "60", "restart")
}

// auditPlan is what the handler does with a message.
type auditPlan struct {
	failures  int
	permanent bool
}

func (p auditPlan) outcomes(max int) []audit.Outcome {
	if p.permanent {
		return []audit.Outcome{audit.OutcomePoisoned}
	}
	var out []audit.Outcome
	for n := 1; n <= max; n++ {
		switch {
		case n > p.failures:
			return append(out, audit.OutcomeSuccess)
		case n == max:
			return append(out, audit.OutcomePoisoned)
		}
		out = append(out, audit.OutcomeRetry)
	}
	return out
}

// A storm through an amqpretry consumer with the audit Recorder and
// Consumer into pgstore on a private PostgreSQL, restarted twice during the
// storm: every message's arrival and every attempt is stored exactly once.
func TestAuditPostgresRestartMidStorm(t *testing.T) {
	if os.Getenv("RABBITRETRY_FAULTS") != "1" {
		t.Skip("starts and restarts a private PostgreSQL and runs a long storm; run it with `make test-faults` (RABBITRETRY_FAULTS=1)")
	}
	uri := brokerURI(t)
	pg := startPrivatePG(t)
	ctx := context.Background()
	store, err := pgstore.New(ctx, pgstore.Config{DSN: pg.dsn()})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()

	prefix := uniquePrefix(t)
	exchange := prefix + ".biz"
	queue := prefix + ".svc"
	naming := audit.Naming{Exchange: prefix + ".audit", AttemptsQueue: prefix + ".attempts", ArrivalsQueue: prefix + ".arrivals"}
	adm := newAdmin(t, uri)
	ch := adm.channel()
	if err := ch.ExchangeDeclare(exchange, "direct", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()
	retryNaming := uniqueNaming(prefix)

	const n, maxAttempts = 600, 3
	rng := rand.New(rand.NewPCG(7, 11))
	plans := map[string]auditPlan{}
	var ids []string
	var pubs []amqp.Publishing
	wantAttempts := 0
	for i := 0; i < n; i++ {
		id := watermill.NewUUID()
		p := auditPlan{failures: rng.IntN(4), permanent: rng.IntN(15) == 0}
		plans[id] = p
		wantAttempts += len(p.outcomes(maxAttempts))
		ids = append(ids, id)
		pubs = append(pubs, amqp.Publishing{Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: id}, Body: []byte(fmt.Sprintf(`{"order":%d}`, i)),
			DeliveryMode: amqp.Persistent, Timestamp: time.Now()})
	}

	// The audit Consumer.
	cons, err := audit.NewConsumer(audit.ConsumerConfig{URI: uri, Store: store, Naming: naming, BatchSize: 100, BatchWait: 50 * time.Millisecond,
		Exchanges:    []audit.Binding{{Exchange: exchange, RoutingKey: routingKey}},
		WriteBackoff: func() backoff.BackOff { return backoff.NewConstantBackOff(200 * time.Millisecond) }})
	if err != nil {
		t.Fatal(err)
	}
	if err := cons.Declare(); err != nil {
		t.Fatal(err)
	}
	cctx, ccancel := context.WithCancel(ctx)
	cdone := make(chan error, 1)
	go func() { cdone <- cons.Run(cctx) }()

	// The retry consumer with the Recorder.
	var retry *amqpretry.Retry
	rec, err := audit.NewRecorder(audit.RecorderConfig{URI: uri, Naming: naming,
		TierFor: func(_ string, d time.Duration) time.Duration { return retry.Topology().TierFor(d) }})
	if err != nil {
		t.Fatal(err)
	}
	subCfg := wamqp.NewDurableQueueConfig(uri)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return exchange }, Type: "direct", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return routingKey }}
	subCfg.Consume.Qos.PrefetchCount = 64
	retry, err = amqpretry.New(amqpretry.Config{URI: uri, Subscriber: subCfg, QueueType: amqpretry.QueueTypeQuorum, Policy: router.Policy{MaxAttempts: maxAttempts, Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(200 * time.Millisecond) }, Observer: middleware.Observers(rec.Observer())},
		Naming: retryNaming,
		Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c := adm.channel()
		if err := audit.DeleteTopology(c, naming); err != nil {
			t.Logf("cleanup: %v", err)
		}
		_ = c.Close()
		adm.deleteAll(append(retry.Topology().WaitQueues(queue), queue, retry.Topology().Naming().PoisonQueue(queue)),
			[]string{exchange, retryNaming.LoopBackExchange, retryNaming.WaitExchange, retryNaming.PoisonExchange})
	})
	sub, err := wamqp.NewSubscriber(retry.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	rt, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string][]int{}
	rt.AddMiddleware(rec.Middleware)
	rt.AddMiddleware(retry.Middleware)
	rt.AddMiddleware(rec.HandlerMiddleware)
	rt.AddConsumerHandler("svc", queue, sub, func(msg *message.Message) error {
		p, ok := plans[msg.UUID]
		if !ok {
			return middleware.Permanent(fmt.Errorf("unknown message %s", msg.UUID))
		}
		a := middleware.Attempt(msg)
		mu.Lock()
		seen[msg.UUID] = append(seen[msg.UUID], a)
		mu.Unlock()
		if p.permanent {
			return middleware.Permanent(errors.New("order references unknown customer"))
		}
		if a <= p.failures {
			return fmt.Errorf("attempt %d: inventory service unavailable", a)
		}
		return nil
	})
	rctx, rcancel := context.WithCancel(ctx)
	rdone := make(chan struct{})
	go func() {
		defer close(rdone)
		if err := rt.Run(rctx); err != nil {
			t.Errorf("router: %v", err)
		}
	}()
	select {
	case <-rt.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}

	// Three waves; PostgreSQL restarts after the first two, while records
	// of the earlier waves are still being written.
	start := time.Now()
	restarts := 0
	for w := 0; w < 3; w++ {
		adm.publish(exchange, routingKey, pubs[w*n/3:(w+1)*n/3]...)
		if w == 2 {
			break
		}
		// Restart as soon as this wave's arrivals are being written, while
		// its attempt records are still coming in.
		target := uint64(w*n/3 + 20)
		waitFor(t, 60*time.Second, fmt.Sprintf("%d arrivals written before restart %d", target, w+1), func() bool { return cons.Stats().Arrivals >= target })
		t0 := time.Now()
		if err := pg.restart(); err != nil {
			t.Fatal(err)
		}
		restarts++
		t.Logf("PostgreSQL restart %d took %v (arrivals written so far %d)", restarts, time.Since(t0).Round(time.Millisecond), cons.Stats().Arrivals)
	}
	complete := func() bool {
		mu.Lock()
		defer mu.Unlock()
		got := 0
		for _, v := range seen {
			got += len(v)
		}
		return got >= wantAttempts
	}
	waitFor(t, 120*time.Second, fmt.Sprintf("%d handler runs", wantAttempts), complete)
	_ = rt.Close()
	rcancel()
	<-rdone
	_ = sub.Close()
	closeCtx, closeCancel := context.WithTimeout(ctx, 60*time.Second)
	defer closeCancel()
	if err := rec.Close(closeCtx); err != nil {
		t.Fatalf("Recorder.Close: %v", err)
	}
	_ = retry.Close()
	waitFor(t, 120*time.Second, "audit queues drained", func() bool {
		return adm.depth(naming.ArrivalsQueue) == 0 && adm.depth(naming.AttemptsQueue) == 0 && cons.Stats().Arrivals >= n &&
			cons.Stats().Attempts >= rec.Stats().Published
	})
	ccancel()
	if err := <-cdone; err != nil {
		t.Fatalf("Consumer.Run: %v", err)
	}

	// Read everything back from PostgreSQL.
	pool, err := pgxpool.New(ctx, pg.dsn())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	arrivals := map[string]int{}
	rows, err := pool.Query(ctx, `SELECT message_id FROM `+auditconst.Schema+`.arrivals`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		arrivals[id]++
	}
	rows.Close()
	attempts := map[string][]string{}
	rows, err = pool.Query(ctx, `SELECT message_id, outcome FROM `+auditconst.Schema+`.attempts ORDER BY message_id, attempt, started_at`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, outcome string
		if err := rows.Scan(&id, &outcome); err != nil {
			t.Fatal(err)
		}
		attempts[id] = append(attempts[id], outcome)
	}
	rows.Close()

	handled, duplicates, lost, storedAttempts := 0, 0, 0, 0
	for _, id := range ids {
		want := plans[id].outcomes(maxAttempts)
		mu.Lock()
		ran := len(seen[id])
		mu.Unlock()
		handled += ran
		switch a := arrivals[id]; {
		case a == 0:
			lost++
			t.Errorf("%s: no arrival", id)
		case a > 1:
			duplicates += a - 1
			t.Errorf("%s: %d arrivals", id, a)
		}
		got := attempts[id]
		storedAttempts += len(got)
		switch {
		case len(got) > len(want):
			duplicates += len(got) - len(want)
		case len(got) < len(want):
			lost += len(want) - len(got)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) || ran != len(want) {
			t.Errorf("%s (%+v): stored outcomes %v, handler ran %d times, want %v", id, plans[id], got, ran, want)
		}
	}
	st := cons.Stats()
	t.Logf("ACCOUNT %s: published=%d handled=%d arrivals=%d attempts=%d (want %d) duplicates=%d lost=%d; PostgreSQL restarts %d, refused writes %d, batches %d, %.1fs",
		t.Name(), n, handled, len(arrivals), storedAttempts, wantAttempts, duplicates, lost, restarts, st.WriteFailures, st.Batches, time.Since(start).Seconds())
	if duplicates != 0 || lost != 0 || restarts != 2 {
		t.Fatalf("duplicates %d, lost %d, restarts %d", duplicates, lost, restarts)
	}
	if st.WriteFailures == 0 {
		t.Errorf("no Write failed: the restarts did not hit the consumer")
	}
}
