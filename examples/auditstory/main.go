// Command auditstory tells the audit story end to end, on RabbitMQ and
// PostgreSQL: orders flow through a billing service; a business bug ships,
// so orders in EUR "succeed" with a wrong charge (nobody notices: the
// handler returned nil) and orders in GBP fail permanently (poisoned). An
// operator searches the audit store, finds exactly the affected orders by
// header value, the fix ships, and the operator resends exactly those
// orders to the billing queue (and no other queue bound to the exchange);
// each is billed once more, correctly, and nothing else is touched.
//
//	go run ./examples/auditstory              # RabbitMQ at AMQP_URI, PostgreSQL at RABBITRETRY_PG_DSN
//	go run ./examples/auditstory -orders 300
//
// Parts: amqpretry (the retry chain), audit.Recorder (one record per
// attempt, published in the background), audit.Consumer (arrivals from the
// business exchange and the attempt records into PostgreSQL, acked after
// commit), audit/pgstore (the store and its search), audit.Resender (resend
// to the original queue only, through the loop-back exchange).
//
// The demo uses its own exchange, queues and database schema (-prefix) and
// deletes them at the end unless -keep is given.
//
// Exit status: 0 when the accounting adds up (every affected order billed
// once more after the fix, every other order billed exactly once, nothing
// lost), 1 otherwise.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// config is what main reads from flags; the test fills it directly.
type config struct {
	URI     string        // AMQP URI
	DSN     string        // PostgreSQL DSN of the audit store
	Prefix  string        // names: exchange <Prefix>.orders, queues <Prefix>.billing and <Prefix>.shipping, schema <Prefix>_audit
	Orders  int           // orders to publish; every third is EUR, every third GBP, the rest USD
	Timeout time.Duration // bound on each wait
	Keep    bool          // keep queues and schema at the end
	Out     io.Writer
}

func defaultConfig() config {
	cfg := config{URI: os.Getenv("AMQP_URI"), DSN: os.Getenv("RABBITRETRY_PG_DSN"), Prefix: "auditstory",
		Orders: 30, Timeout: 60 * time.Second, Out: os.Stdout}
	if cfg.URI == "" {
		cfg.URI = "amqp://guest:guest@127.0.0.1:5672/"
	}
	if cfg.DSN == "" {
		cfg.DSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	return cfg
}

func main() {
	cfg := defaultConfig()
	flag.StringVar(&cfg.URI, "uri", cfg.URI, "AMQP URI (default $AMQP_URI)")
	flag.StringVar(&cfg.DSN, "dsn", cfg.DSN, "PostgreSQL DSN of the audit store (default $RABBITRETRY_PG_DSN)")
	flag.StringVar(&cfg.Prefix, "prefix", cfg.Prefix, "name prefix of the demo's exchange, queues and schema")
	flag.IntVar(&cfg.Orders, "orders", cfg.Orders, "orders to publish (a third each in EUR, GBP, USD)")
	flag.DurationVar(&cfg.Timeout, "timeout", cfg.Timeout, "give up waiting after this long")
	flag.BoolVar(&cfg.Keep, "keep", false, "keep the demo's queues and schema")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	s, err := run(ctx, cfg)
	s.print(cfg.Out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "auditstory:", err)
		os.Exit(1)
	}
	if !s.OK() {
		fmt.Fprintln(os.Stderr, "auditstory: the accounting does not add up")
		os.Exit(1)
	}
}

type order struct {
	ID       int    `json:"id"`
	Currency string `json:"currency"`
	Amount   int    `json:"amount_cents"`
}

// summary is the story's accounting.
type summary struct {
	Published     int // orders published
	WronglyBilled int // EUR orders billed by the buggy version (success, wrong charge)
	Poisoned      int // GBP orders poisoned by the buggy version
	Found         int // affected orders the operator found in the audit store
	Resent        int // resent after the fix
	Rebilled      int // affected orders billed once more, by the fixed version
	Untouched     int // USD orders billed exactly once, never resent
	Duplicates    int // orders billed more often than the story allows
	Lost          int // orders never billed
	Shipping      int // messages the other queue bound to the exchange got (must stay Published)
}

// OK reports whether the accounting adds up.
func (s summary) OK() bool {
	affected := s.WronglyBilled + s.Poisoned
	return s.Published > 0 && affected > 0 && s.Found == affected && s.Resent == affected &&
		s.Rebilled == affected && s.Untouched == s.Published-affected && s.Duplicates == 0 &&
		s.Lost == 0 && s.Shipping == s.Published
}

func (s summary) print(w io.Writer) {
	fmt.Fprintln(w)
	fmt.Fprintln(w, "== summary")
	fmt.Fprintf(w, "orders published:                 %d\n", s.Published)
	fmt.Fprintf(w, "billed wrongly by the bug (EUR):  %d\n", s.WronglyBilled)
	fmt.Fprintf(w, "poisoned by the bug (GBP):        %d\n", s.Poisoned)
	fmt.Fprintf(w, "found in the audit store:         %d\n", s.Found)
	fmt.Fprintf(w, "resent after the fix:             %d\n", s.Resent)
	fmt.Fprintf(w, "billed once more, correctly:      %d\n", s.Rebilled)
	fmt.Fprintf(w, "untouched (USD, billed once):     %d\n", s.Untouched)
	fmt.Fprintf(w, "shipping queue got (no resends):  %d\n", s.Shipping)
	fmt.Fprintf(w, "duplicates: %d   lost: %d\n", s.Duplicates, s.Lost)
}

// billing is the service: its handler bills an order; fixed says whether
// the bug fix has shipped.
type billing struct {
	mu      sync.Mutex
	fixed   bool
	billed  map[string][]bool // message UUID -> one entry per billing, true if correct
	byID    map[string]order
	handled map[string]bool // message UUID -> settled at least once (billed or poisoned)
}

var errCurrency = errors.New("currency not supported")

func (b *billing) handle(msg *message.Message) error {
	var o order
	if err := json.Unmarshal(msg.Payload, &o); err != nil {
		return middleware.Permanent(fmt.Errorf("decoding order: %w", err))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.byID[msg.UUID] = o
	if !b.fixed && o.Currency == "GBP" {
		b.handled[msg.UUID] = true
		return middleware.Permanent(fmt.Errorf("order %d: %w: %s", o.ID, errCurrency, o.Currency))
	}
	correct := b.fixed || o.Currency != "EUR" // the bug: EUR amounts billed at the USD rate
	b.billed[msg.UUID] = append(b.billed[msg.UUID], correct)
	b.handled[msg.UUID] = true
	return nil
}

func (b *billing) count(f func(uuid string, bills []bool) bool) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for id := range b.handled {
		if f(id, b.billed[id]) {
			n++
		}
	}
	return n
}

// waitFor polls cond every 50 ms until it holds or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, what string, cond func() (bool, error)) error {
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
			return fmt.Errorf("%s: not after %s", what, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func run(ctx context.Context, cfg config) (sum summary, err error) {
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	if cfg.Orders < 3 {
		return sum, fmt.Errorf("-orders must be >= 3, got %d", cfg.Orders)
	}
	out := cfg.Out
	start := time.Now()
	logf := func(format string, args ...any) {
		fmt.Fprintf(out, "%7.3fs  "+format+"\n", append([]any{time.Since(start).Seconds()}, args...)...)
	}
	logger := watermill.NopLogger{}
	exchange := cfg.Prefix + ".orders"
	billingQ, shippingQ := cfg.Prefix+".billing", cfg.Prefix+".shipping"
	schema := cfg.Prefix + "_audit"
	naming := audit.Naming{Exchange: cfg.Prefix + ".audit", AttemptsQueue: cfg.Prefix + ".audit.attempts",
		ArrivalsQueue: cfg.Prefix + ".audit.arrivals"}

	// --- the audit store and the business exchange --------------------------
	store, err := pgstore.New(ctx, pgstore.Config{DSN: cfg.DSN, Schema: schema})
	if err != nil {
		return sum, fmt.Errorf("audit store (PostgreSQL; start it with scripts/ensure-postgres.sh): %w", err)
	}
	defer store.Close()
	conn, err := amqp.Dial(cfg.URI)
	if err != nil {
		return sum, fmt.Errorf("RabbitMQ (start it with `make broker`): %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return sum, err
	}
	if err := ch.ExchangeDeclare(exchange, "topic", true, false, false, false, nil); err != nil {
		return sum, err
	}
	// The shipping service's queue: bound to the same exchange and key, so a
	// resend to the exchange would reach it too; a resend to the billing
	// queue must not.
	if _, err := ch.QueueDeclare(shippingQ, true, false, false, false, nil); err != nil {
		return sum, err
	}
	if err := ch.QueueBind(shippingQ, "order.created", exchange, false, nil); err != nil {
		return sum, err
	}

	// --- the audit pipeline: consumer into PostgreSQL -----------------------
	consumer, err := audit.NewConsumer(audit.ConsumerConfig{URI: cfg.URI, Store: store, Naming: naming,
		Exchanges: []audit.Binding{{Exchange: exchange}}, BatchWait: 50 * time.Millisecond})
	if err != nil {
		return sum, err
	}
	if err := consumer.Declare(); err != nil {
		return sum, err
	}
	cctx, stopConsumer := context.WithCancel(ctx)
	consumerDone := make(chan error, 1)
	go func() { consumerDone <- consumer.Run(cctx) }()
	defer func() { stopConsumer(); <-consumerDone }()

	// --- the billing service: retry chain + recorder --------------------------
	subCfg := wamqp.NewDurableQueueConfig(cfg.URI)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return exchange }, Type: "topic", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "order.created" }}
	subCfg.Consume.Qos.PrefetchCount = 16
	queueName := func(ctx context.Context) string { return message.SubscribeTopicFromCtx(ctx) }
	rec, err := audit.NewRecorder(audit.RecorderConfig{URI: cfg.URI, Naming: naming, QueueName: queueName})
	if err != nil {
		return sum, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rec.Close(cctx)
	}()
	retry, err := amqpretry.New(amqpretry.Config{URI: cfg.URI, Subscriber: subCfg, Policy: router.Policy{MaxAttempts: 3, Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(200 * time.Millisecond) }, Observer: rec.Observer()}, Logger: logger}) // with metrics too: middleware.Observers(m.Observer(), rec.Observer())

	if err != nil {
		return sum, err
	}
	defer retry.Close()
	defer func() {
		if !cfg.Keep {
			_ = retry.DeleteQueues(billingQ)
			_, _ = ch.QueueDelete(shippingQ, false, false, false)
			_ = audit.DeleteTopology(ch, naming)
			_ = ch.ExchangeDelete(exchange, false, false)
			_, _ = store.Pool().Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
		}
	}()
	_ = retry.DeleteQueues(billingQ) // start from zero
	sub, err := retry.NewSubscriber(logger, 0)
	if err != nil {
		return sum, err
	}
	defer sub.Close()
	svc := &billing{billed: map[string][]bool{}, byID: map[string]order{}, handled: map[string]bool{}}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return sum, err
	}
	r.AddMiddleware(rec.Middleware)        // outside the chain: one record per attempt
	r.AddMiddleware(retry.Middleware)      // the retry chain
	r.AddMiddleware(rec.HandlerMiddleware) // inside: handler duration and error
	r.AddConsumerHandler("billing", billingQ, sub, svc.handle)
	go func() { _ = r.Run(ctx) }()
	defer r.Close()
	select {
	case <-r.Running():
	case <-ctx.Done():
		return sum, ctx.Err()
	}

	// --- 1. orders flow; the buggy version is running -----------------------
	pubCh, err := conn.Channel()
	if err != nil {
		return sum, err
	}
	if err := pubCh.Confirm(false); err != nil {
		return sum, err
	}
	currencies := []string{"USD", "EUR", "GBP"}
	for i := 1; i <= cfg.Orders; i++ {
		o := order{ID: i, Currency: currencies[i%3], Amount: 1000 + i}
		body, _ := json.Marshal(o)
		dc, err := pubCh.PublishWithDeferredConfirmWithContext(ctx, exchange, "order.created", true, false, amqp.Publishing{
			Headers:     amqp.Table{"_watermill_message_uuid": watermill.NewUUID(), "currency": o.Currency, "order-id": int64(o.ID)},
			ContentType: "application/json", DeliveryMode: amqp.Persistent, Timestamp: time.Now(), Body: body,
		})
		if err != nil {
			return sum, err
		}
		if ok, err := dc.WaitContext(ctx); err != nil || !ok {
			return sum, fmt.Errorf("order %d not confirmed: %v", i, err)
		}
		sum.Published++
	}
	logf("published %d orders to %s (USD, EUR, GBP in turn); billing v1 (with the bug) is running", sum.Published, exchange)
	if err := waitFor(ctx, cfg.Timeout, "billing v1 settling every order", func() (bool, error) {
		return svc.count(func(string, []bool) bool { return true }) == sum.Published, nil
	}); err != nil {
		return sum, err
	}
	sum.WronglyBilled = svc.count(func(_ string, b []bool) bool { return len(b) == 1 && !b[0] })
	sum.Poisoned = svc.count(func(_ string, b []bool) bool { return len(b) == 0 })
	logf("billing v1 settled every order: %d billed wrongly (nobody noticed: success), %d poisoned", sum.WronglyBilled, sum.Poisoned)

	// --- 2. the operator searches the audit store ----------------------------
	// The records reach PostgreSQL through RabbitMQ, a moment after the
	// handler; wait until every attempt is there.
	if err := waitFor(ctx, cfg.Timeout, "audit records in PostgreSQL", func() (bool, error) {
		st, err := store.Stats(ctx)
		return err == nil && st.Arrivals >= int64(sum.Published) && st.Attempts >= int64(sum.Published), err
	}); err != nil {
		return sum, err
	}
	eur := audit.Filter{Exchange: exchange, Headers: map[string]any{"currency": "EUR"}, LastOutcome: audit.OutcomeSuccess, Limit: 10000}
	gbp := audit.Filter{Exchange: exchange, LastOutcome: audit.OutcomePoisoned, ErrorClass: middleware.ClassPermanent, Limit: 10000}
	foundEUR, err := store.Search(ctx, eur)
	if err != nil {
		return sum, err
	}
	foundGBP, err := store.Search(ctx, gbp)
	if err != nil {
		return sum, err
	}
	sum.Found = len(foundEUR) + len(foundGBP)
	fmt.Fprintln(out, "\n$ auditctl search --exchange "+exchange+" --header currency=EUR --last-outcome success")
	printMessages(out, foundEUR, 3)
	fmt.Fprintln(out, "\n$ auditctl search --exchange "+exchange+" --last-outcome poisoned --class permanent")
	printMessages(out, foundGBP, 3)

	// --- 3. the fix ships; the operator resends exactly the affected orders -
	svc.mu.Lock()
	svc.fixed = true
	svc.mu.Unlock()
	logf("billing v2 (the fix) ships")
	resender, err := audit.NewResender(audit.ResenderConfig{URI: cfg.URI, Store: store})
	if err != nil {
		return sum, err
	}
	defer resender.Close()
	for _, f := range []audit.Filter{eur, gbp} {
		dry, err := resender.Resend(ctx, f, audit.ResendOptions{Mode: audit.ResendToQueue, Queue: billingQ, DryRun: true})
		if err != nil {
			return sum, err
		}
		logf("resend --to-queue %s --dry-run: would send %d", billingQ, dry.Sent)
		// More than ConfirmAbove (10) messages: the resend must say it means
		// them all, and how many the dry run found (auditctl resend --yes).
		rep, err := resender.Resend(ctx, f, audit.ResendOptions{Mode: audit.ResendToQueue, Queue: billingQ,
			AllowAll: true, ExpectedCount: dry.Matched})
		if err != nil {
			return sum, err
		}
		logf("resend --to-queue %s: sent %d, failed %d, skipped %d (confirmed by the broker)", billingQ, rep.Sent, rep.Failed, rep.Skipped)
		sum.Resent += rep.Sent
	}

	// --- 4. each affected order is billed once more, correctly ---------------
	affected := sum.WronglyBilled + sum.Poisoned
	if err := waitFor(ctx, cfg.Timeout, "every resent order billed by v2", func() (bool, error) {
		return svc.count(func(id string, b []bool) bool { return svc.byID[id].Currency != "USD" && len(b) > 0 && b[len(b)-1] }) >= affected, nil
	}); err != nil {
		return sum, err
	}
	// The shipping queue got every order once, and no resend.
	if err := waitFor(ctx, cfg.Timeout, "shipping queue depth", func() (bool, error) {
		q, err := ch.QueueDeclarePassive(shippingQ, true, false, false, false, nil)
		if err != nil {
			return false, err
		}
		sum.Shipping = q.Messages
		return q.Messages >= sum.Published, nil
	}); err != nil {
		return sum, err
	}
	svc.mu.Lock()
	for id := range svc.handled {
		bills := svc.billed[id]
		switch svc.byID[id].Currency {
		case "EUR": // once wrongly, once more correctly
			if len(bills) == 2 && !bills[0] && bills[1] {
				sum.Rebilled++
			} else if len(bills) > 2 {
				sum.Duplicates++
			}
		case "GBP": // poisoned, then billed once, correctly
			if len(bills) == 1 && bills[0] {
				sum.Rebilled++
			} else if len(bills) > 1 {
				sum.Duplicates++
			}
		default:
			if len(bills) == 1 && bills[0] {
				sum.Untouched++
			} else if len(bills) > 1 {
				sum.Duplicates++
			}
		}
	}
	sum.Lost = sum.Published - len(svc.handled)
	svc.mu.Unlock()
	logf("done: %d affected orders billed once more by v2, %d USD orders untouched", sum.Rebilled, sum.Untouched)

	// The audit store now tells one order's whole story.
	if len(foundGBP) > 0 {
		id := foundGBP[0].MessageID
		_ = waitFor(ctx, cfg.Timeout, "the resent attempt recorded", func() (bool, error) {
			m, ok, err := store.Get(ctx, id)
			return ok && len(m.Attempts) >= 2, err
		})
		if m, ok, err := store.Get(ctx, id); err == nil && ok {
			fmt.Fprintln(out, "\n$ auditctl show "+id)
			printStory(out, m)
		}
	}
	return sum, nil
}

func printMessages(w io.Writer, ms []audit.Message, max int) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MESSAGE ID\tORDER\tCURRENCY\tATTEMPTS\tLAST OUTCOME\tERROR")
	for i, m := range ms {
		if i == max {
			fmt.Fprintf(tw, "... %d more\t\t\t\t\t\n", len(ms)-max)
			break
		}
		var cur, id any
		if m.Arrival != nil {
			cur, id = m.Arrival.Headers["currency"], m.Arrival.Headers["order-id"]
		}
		last := audit.Attempt{}
		if len(m.Attempts) > 0 {
			last = m.Attempts[len(m.Attempts)-1]
		}
		fmt.Fprintf(tw, "%s\t%v\t%v\t%d\t%s\t%s\n", m.MessageID, id, cur, len(m.Attempts), last.Outcome, last.Error)
	}
	_ = tw.Flush()
}

func printStory(w io.Writer, m audit.Message) {
	if a := m.Arrival; a != nil {
		fmt.Fprintf(w, "arrived %s on %s (%s), %d bytes: %s\n", a.ArrivedAt.Format(time.RFC3339Nano), a.Exchange, a.RoutingKey, a.BodySize, a.Body)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ATTEMPT\tQUEUE\tSTARTED\tTOOK\tOUTCOME\tCLASS\tERROR")
	for _, at := range m.Attempts {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", at.Attempt, at.Queue, at.StartedAt.Format("15:04:05.000"), at.Duration.Round(time.Microsecond), at.Outcome, at.ErrorClass, at.Error)
	}
	_ = tw.Flush()
}
