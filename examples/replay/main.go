// Command replay runs the library's "operate it" story: a mailer service
// ships with a bug (its mail-server stand-in rejects every customer of the
// domain example.invalid, a permanent error), so those orders land in the
// poison queue. An operator looks at the poison queue, fixes the mailer and
// replays exactly the affected messages; every order ends up mailed exactly
// once, and the Prometheus metrics tell the same story.
//
//	go run ./examples/replay                                # RabbitMQ at AMQP_URI
//	go run ./examples/replay -metrics-addr 127.0.0.1:9464   # fixed metrics port
//
// Orders are published to the topic exchange "orders" with routing key
// "order.created", as in examples/quickstart, but the mailer here consumes
// its own queue, "replay-demo.mailer" (see -prefix), so the two examples do
// not take each other's messages. The demo deletes its queues at the start
// and, unless -keep is given, at the end.
//
// Exit status: 0 when every order was mailed exactly once and the metrics
// agree, 1 otherwise.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/metrics"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/poison/admin"
	"github.com/rabbitretry/rabbitretry/router"
)

// blockedDomain is the domain the buggy mailer cannot deliver to.
const blockedDomain = "example.invalid"

// runKey is the metadata key that tags the orders of one run, so that orders
// other programs publish to the shared "orders" exchange are ignored.
const runKey = "replay-demo-run"

// config is what main reads from flags; the test fills it directly.
type config struct {
	URI         string        // AMQP URI
	Prefix      string        // queue name prefix: the mailer consumes <Prefix>.mailer
	Exchange    string        // topic exchange the orders are published to
	RoutingKey  string        // routing key of the orders
	Orders      int           // orders to publish
	Blocked     int           // how many of them go to customers at blockedDomain
	MetricsAddr string        // listen address of the /metrics endpoint
	Timeout     time.Duration // bound on each wait
	Keep        bool          // keep the queues at the end
	Out         io.Writer     // where the story is told
}

func defaultConfig() config {
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5672/"
	}
	return config{
		URI: uri, Prefix: "replay-demo", Exchange: "orders", RoutingKey: "order.created",
		Orders: 30, Blocked: 10, MetricsAddr: "127.0.0.1:0", Timeout: 60 * time.Second, Out: os.Stdout,
	}
}

// summary is the outcome of the story.
type summary struct {
	Published   int // orders published
	Poisoned    int // in the poison queue after the first pass
	Replayed    int // replayed by admin.Replay
	Mailed      int // distinct orders mailed
	MailedOnce  int // orders mailed exactly once
	Duplicates  int // orders mailed more than once
	Lost        int // published, never mailed
	PoisonLeft  int // poison queue depth at the end
	Ignored     int // foreign orders (other publishers on the exchange) ignored
	Metrics     string
	MetricsBad  []string // expected metric lines missing from the scrape
	MetricsURL  string
	MailerQueue string
	Exchange    string
}

// OK reports whether the accounting adds up.
func (s summary) OK() bool {
	return s.Published > 0 && s.Mailed == s.Published && s.MailedOnce == s.Published && s.Duplicates == 0 &&
		s.Lost == 0 && s.PoisonLeft == 0 && s.Replayed == s.Poisoned && len(s.MetricsBad) == 0
}

func (s summary) print(w io.Writer) {
	fmt.Fprintln(w)
	fmt.Fprintln(w, "== summary")
	fmt.Fprintf(w, "orders published:            %d\n", s.Published)
	fmt.Fprintf(w, "poisoned by the bug:         %d\n", s.Poisoned)
	fmt.Fprintf(w, "replayed after the fix:      %d\n", s.Replayed)
	fmt.Fprintf(w, "mailed:                      %d\n", s.Mailed)
	fmt.Fprintf(w, "each exactly once:           %v (%d of %d, %d duplicates)\n", s.MailedOnce == s.Published && s.Duplicates == 0, s.MailedOnce, s.Published, s.Duplicates)
	fmt.Fprintf(w, "left in the poison queue:    %d\n", s.PoisonLeft)
	fmt.Fprintf(w, "lost:                        %d\n", s.Lost)
	if s.Ignored > 0 {
		fmt.Fprintf(w, "foreign orders ignored:      %d (published to %q by another program)\n", s.Ignored, s.Exchange)
	}
	if len(s.MetricsBad) == 0 {
		fmt.Fprintln(w, "metrics agree:               true")
	} else {
		fmt.Fprintln(w, "metrics agree:               false, missing:")
		for _, l := range s.MetricsBad {
			fmt.Fprintln(w, "  "+l)
		}
	}
}

func main() {
	cfg := defaultConfig()
	flag.StringVar(&cfg.MetricsAddr, "metrics-addr", cfg.MetricsAddr, "listen address of the /metrics endpoint (port 0: a random port)")
	flag.StringVar(&cfg.Prefix, "prefix", cfg.Prefix, "queue name prefix: the mailer consumes <prefix>.mailer")
	flag.StringVar(&cfg.Exchange, "exchange", cfg.Exchange, "topic exchange the orders are published to")
	flag.IntVar(&cfg.Orders, "orders", cfg.Orders, "number of orders to publish")
	flag.IntVar(&cfg.Blocked, "blocked", cfg.Blocked, "how many orders go to customers at "+blockedDomain)
	flag.DurationVar(&cfg.Timeout, "timeout", cfg.Timeout, "give up waiting after this long")
	flag.BoolVar(&cfg.Keep, "keep", false, "keep the demo's queues at the end")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	s, err := run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "replay:", err)
		os.Exit(1)
	}
	s.print(cfg.Out)
	if !s.OK() {
		fmt.Fprintln(os.Stderr, "replay: the accounting does not add up")
		os.Exit(1)
	}
}

type order struct {
	ID    int    `json:"id"`
	Email string `json:"email"`
}

// demo is the mailer service and the story's bookkeeping.
type demo struct {
	cfg   config
	start time.Time
	runID string

	// mailServerRejects is the bug: while set, the mail server stand-in
	// rejects every address at blockedDomain.
	mailServerRejects atomic.Bool

	mu sync.Mutex
	// published, mailed and ignored are guarded by mu.
	published map[string]order
	mailed    map[string]int // successful mails per order UUID
	ignored   int
}

func (d *demo) logf(format string, args ...any) {
	fmt.Fprintf(d.cfg.Out, "%7.3fs  "+format+"\n", append([]any{time.Since(d.start).Seconds()}, args...)...)
}

func (d *demo) println(a ...any) { fmt.Fprintln(d.cfg.Out, a...) }

// lockedWriter serialises writes: the handler logs from the router's
// goroutines while the story goes on.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// mailer is the handler: it "sends" the order confirmation.
func (d *demo) mailer(msg *message.Message) error {
	var o order
	if err := json.Unmarshal(msg.Payload, &o); err != nil {
		return fmt.Errorf("decoding order: %w", err)
	}
	attempt := middleware.Attempt(msg)
	blocked := strings.HasSuffix(o.Email, "@"+blockedDomain)
	if blocked && d.mailServerRejects.Load() {
		d.logf("mailer   order %-3d attempt %d: mail server rejected %s", o.ID, attempt, o.Email)
		return middleware.Permanent(errors.New("mail server rejected domain " + blockedDomain))
	}
	d.mu.Lock()
	d.mailed[msg.UUID]++
	d.mu.Unlock()
	if blocked || msg.Metadata.Get(middleware.ReplayedKey) != "" {
		d.logf("mailer   order %-3d attempt %d: mail sent to %s (replayed %s)", o.ID, attempt, o.Email, msg.Metadata.Get(middleware.ReplayedKey))
	}
	return nil
}

// onlyOurOrders acks, without handling, orders that other programs publish
// to the same exchange: the demo's queue receives every "order.created".
func (d *demo) onlyOurOrders(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get(runKey) != d.runID {
			d.mu.Lock()
			d.ignored++
			d.mu.Unlock()
			return nil, nil
		}
		return h(msg)
	}
}

func (d *demo) counts() (mailed int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.mailed)
}

// backoffPolicy: 100 ms, 200 ms with ±20% jitter. The bug is permanent, so
// the story schedules no retries; the tiers are declared all the same.
func backoffPolicy() backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 100 * time.Millisecond
	b.RandomizationFactor = 0.2
	b.Multiplier = 2
	b.MaxElapsedTime = 0
	return b
}

func run(ctx context.Context, cfg config) (sum summary, err error) {
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	cfg.Out = &lockedWriter{w: cfg.Out}
	if cfg.Orders < 1 || cfg.Blocked < 0 || cfg.Blocked > cfg.Orders {
		return sum, fmt.Errorf("need 0 <= blocked (%d) <= orders (%d) and orders >= 1", cfg.Blocked, cfg.Orders)
	}
	d := &demo{cfg: cfg, start: time.Now(), runID: watermill.NewShortUUID(),
		published: map[string]order{}, mailed: map[string]int{}}
	d.mailServerRejects.Store(true)
	logger := watermill.NopLogger{}
	queue := cfg.Prefix + ".mailer"
	sum.MailerQueue = queue
	sum.Exchange = cfg.Exchange

	// --- 1. the mailer service, with metrics --------------------------------
	reg := prometheus.NewRegistry()
	m, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		return sum, err
	}
	subCfg := wamqp.NewDurableQueueConfig(cfg.URI)
	subCfg.Exchange = wamqp.ExchangeConfig{
		GenerateName: func(string) string { return cfg.Exchange }, Type: "topic", Durable: true,
	}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return cfg.RoutingKey }}
	subCfg.Consume.Qos.PrefetchCount = 16
	retry, err := amqpretry.New(amqpretry.Config{
		URI: cfg.URI, Subscriber: subCfg, Policy: router.Policy{MaxAttempts: 3, Backoff: backoffPolicy, Observer: m.Observer()}, Logger: logger,
	})
	if err != nil {
		return sum, fmt.Errorf("connecting to RabbitMQ at %s: %w (start it with `make broker`)", redactURI(cfg.URI), err)
	}
	defer retry.Close()
	poisonQueue := retry.Topology().Naming().PoisonQueue(queue)
	if err := retry.DeleteQueues(queue); err != nil { // start from zero
		return sum, err
	}
	if !cfg.Keep {
		defer func() {
			if derr := retry.DeleteQueues(queue); derr != nil && err == nil {
				err = derr
			}
		}()
	}

	ln, err := net.Listen("tcp", cfg.MetricsAddr)
	if err != nil {
		return sum, fmt.Errorf("metrics listener: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Timeout: 5 * time.Second}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	sum.MetricsURL = "http://" + ln.Addr().String() + "/metrics"

	sub, err := retry.NewSubscriber(logger, 0) // drains in-flight handlers on shutdown
	if err != nil {
		return sum, err
	}
	defer sub.Close()
	pubCfg := wamqp.NewDurableQueueConfig(cfg.URI)
	pubCfg.Exchange = subCfg.Exchange
	pubCfg.Publish.GenerateRoutingKey = func(string) string { return cfg.RoutingKey }
	pub, err := wamqp.NewPublisher(pubCfg, logger)
	if err != nil {
		return sum, err
	}
	defer pub.Close()

	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return sum, err
	}
	// onlyOurOrders first (outermost), then the retry chain, then the
	// attempt counter inside it.
	r.AddMiddleware(d.onlyOurOrders, retry.Middleware, m.Middleware)
	r.AddConsumerHandler("mailer", queue, sub, d.mailer)
	rctx, stopRouter := context.WithCancel(ctx)
	defer stopRouter()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(rctx) }()
	routerClosed := false
	closeRouter := func() {
		if !routerClosed {
			routerClosed = true
			_ = r.Close()
		}
	}
	defer closeRouter()
	select {
	case <-r.Running():
	case err := <-errc:
		return sum, err
	case <-ctx.Done():
		return sum, ctx.Err()
	}
	d.println("== 1. the mailer is running (with a bug: its mail server rejects @" + blockedDomain + ")")
	fmt.Fprintf(cfg.Out, "queue %s bound to exchange %q with key %q; retry tiers %v; poison queue %s\n",
		queue, cfg.Exchange, cfg.RoutingKey, retry.Topology().Tiers(), poisonQueue)
	fmt.Fprintf(cfg.Out, "metrics: %s\n", sum.MetricsURL)

	// --- 2. publish, wait for the first pass -------------------------------
	d.println()
	d.println("== 2. orders come in")
	msgs := make([]*message.Message, 0, cfg.Orders)
	for i := 1; i <= cfg.Orders; i++ {
		o := order{ID: i, Email: fmt.Sprintf("customer%d@example.com", i)}
		if i*cfg.Blocked/cfg.Orders > (i-1)*cfg.Blocked/cfg.Orders { // spread evenly: every 3rd of 30
			o.Email = fmt.Sprintf("customer%d@%s", i, blockedDomain)
		}
		payload, _ := json.Marshal(o)
		msg := message.NewMessage(watermill.NewUUID(), payload)
		msg.Metadata.Set(runKey, d.runID)
		d.published[msg.UUID] = o
		msgs = append(msgs, msg)
	}
	blocked := blockedCount(d)
	sum.Published = len(msgs)
	d.logf("publishing %d orders to %q (%d of them for customers @%s)", len(msgs), cfg.Exchange, blocked, blockedDomain)
	if err := pub.Publish(cfg.Exchange, msgs...); err != nil {
		return sum, fmt.Errorf("publishing orders: %w", err)
	}
	if err := waitFor(ctx, cfg.Timeout, func() (bool, error) {
		depth, err := queueDepth(cfg.URI, poisonQueue)
		return d.counts() == cfg.Orders-blocked && depth == blocked, err
	}); err != nil {
		return sum, fmt.Errorf("waiting for %d mailed and %d poisoned (mailed %d): %w", cfg.Orders-blocked, blocked, d.counts(), err)
	}
	d.logf("first pass done: %d mailed, %d in %s", d.counts(), blocked, poisonQueue)

	// --- 3. the operator looks at the poison queue -------------------------
	d.println()
	d.println("== 3. the operator inspects the poison queue")
	adm, err := admin.New(admin.Config{URI: cfg.URI})
	if err != nil {
		return sum, err
	}
	defer adm.Close()
	st, err := adm.Stats(ctx, poisonQueue)
	if err != nil {
		return sum, fmt.Errorf("stats: %w", err)
	}
	sum.Poisoned = st.Depth
	fmt.Fprintf(cfg.Out, "$ go run ./cmd/poisonctl --queue %s stats\n", poisonQueue)
	fmt.Fprintf(cfg.Out, "depth %d, consumers %d; by class %v; by handler %v; by original queue %v\n",
		st.Depth, st.Consumers, st.ByClass, st.ByHandler, st.ByOriginalQueue)
	list, err := adm.List(ctx, poisonQueue, admin.Filter{})
	if err != nil {
		return sum, fmt.Errorf("list: %w", err)
	}
	orderOf := func(pm admin.Message) order {
		var o order
		_ = json.Unmarshal(pm.Body, &o)
		return o
	}
	sort.SliceStable(list, func(i, j int) bool { return orderOf(list[i]).ID < orderOf(list[j]).ID })
	fmt.Fprintf(cfg.Out, "$ go run ./cmd/poisonctl --queue %s list\n", poisonQueue)
	tw := tabwriter.NewWriter(cfg.Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "UUID\tATTEMPTS\tCLASS\tREASON\tORDER (body)")
	for _, pm := range list {
		o := orderOf(pm)
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t#%d %s\n", pm.UUID, pm.Attempts, pm.Class, pm.Reason, o.ID, o.Email)
	}
	_ = tw.Flush()
	fmt.Fprintln(cfg.Out, "the same from a shell (it reads AMQP_URI):")
	for _, c := range []string{
		"stats",
		"list",
		"list --reason " + blockedDomain + " --json",
		"show " + firstUUID(list),
		"replay --reason " + blockedDomain + " --dry-run",
		"replay --reason " + blockedDomain,
	} {
		fmt.Fprintf(cfg.Out, "  go run ./cmd/poisonctl --queue %s %s\n", poisonQueue, c)
	}

	// --- 4. fix, replay, verify --------------------------------------------
	d.println()
	d.println("== 4. fix the mailer, replay what the bug poisoned")
	d.mailServerRejects.Store(false)
	d.logf("mailer fixed: the mail server accepts @%s again", blockedDomain)
	filter := admin.Filter{ReasonContains: blockedDomain}
	fmt.Fprintf(cfg.Out, "$ go run ./cmd/poisonctl --queue %s replay --reason %s\n", poisonQueue, blockedDomain)
	res, err := adm.Replay(ctx, poisonQueue, filter, admin.ReplayOptions{
		Progress: func(done, total int) {
			if done == total || done%5 == 0 {
				d.logf("replay   %d/%d", done, total)
			}
		},
	})
	sum.Replayed = res.Replayed
	if err != nil {
		return sum, fmt.Errorf("replay: %w", err)
	}
	d.logf("replayed %d (matched %d, skipped %d, errors %d, possibly duplicated %d)",
		res.Replayed, res.Matched, res.Skipped, len(res.Errors), len(res.Duplicated))
	for _, e := range res.Errors {
		d.logf("replay error: %v", e)
	}
	if err := waitFor(ctx, cfg.Timeout, func() (bool, error) { return d.counts() == cfg.Orders, nil }); err != nil {
		return sum, fmt.Errorf("waiting for all %d orders to be mailed (mailed %d): %w", cfg.Orders, d.counts(), err)
	}
	d.logf("all %d orders mailed", d.counts())
	// Closing the router waits for handlers in flight, and so for their
	// metrics: the scrape below sees the final numbers.
	closeRouter()
	if err := <-errc; err != nil {
		return sum, fmt.Errorf("router: %w", err)
	}
	st, err = adm.Stats(ctx, poisonQueue)
	if err != nil {
		return sum, fmt.Errorf("stats: %w", err)
	}
	sum.PoisonLeft = st.Depth
	fmt.Fprintf(cfg.Out, "$ go run ./cmd/poisonctl --queue %s stats\n", poisonQueue)
	fmt.Fprintf(cfg.Out, "depth %d\n", st.Depth)

	fmt.Fprintf(cfg.Out, "$ curl -s %s | grep ^rabbitretry_\n", sum.MetricsURL)
	sum.Metrics, err = scrape(ctx, sum.MetricsURL)
	if err != nil {
		return sum, err
	}
	fmt.Fprint(cfg.Out, sum.Metrics)
	for _, want := range []string{
		fmt.Sprintf(`rabbitretry_poisoned_total{class="permanent",queue=%q} %d`, queue, blocked),
		fmt.Sprintf(`rabbitretry_attempts_total{outcome="success",queue=%q} %d`, queue, cfg.Orders),
		fmt.Sprintf(`rabbitretry_attempts_total{outcome="error",queue=%q} %d`, queue, blocked),
	} {
		if !containsLine(sum.Metrics, want) {
			sum.MetricsBad = append(sum.MetricsBad, want)
		}
	}

	// --- 5. the accounting --------------------------------------------------
	d.mu.Lock()
	for id := range d.published {
		switch n := d.mailed[id]; {
		case n == 0:
			sum.Lost++
		case n == 1:
			sum.MailedOnce++
		default:
			sum.Duplicates++
		}
		if d.mailed[id] > 0 {
			sum.Mailed++
		}
	}
	sum.Ignored = d.ignored
	d.mu.Unlock()
	return sum, nil
}

// blockedCount counts the published orders at blockedDomain.
func blockedCount(d *demo) int {
	n := 0
	for _, o := range d.published {
		if strings.HasSuffix(o.Email, "@"+blockedDomain) {
			n++
		}
	}
	return n
}

func firstUUID(list []admin.Message) string {
	if len(list) == 0 {
		return "<uuid>"
	}
	return list[0].UUID
}

// waitFor polls cond every 50 ms until it holds, ctx ends or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var lastErr error
	for {
		ok, err := cond()
		if ok && err == nil {
			return nil
		}
		lastErr = err
		select {
		case <-ctx.Done():
			return errors.Join(ctx.Err(), lastErr)
		case <-deadline.C:
			return errors.Join(fmt.Errorf("timed out after %v", timeout), lastErr)
		case <-tick.C:
		}
	}
}

// queueDepth returns the number of ready messages in queue (passive declare).
func queueDepth(uri, queue string) (int, error) {
	conn, err := amqp.Dial(uri)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	return q.Messages, nil
}

// scrape GETs the metrics endpoint and returns its rabbitretry_* sample lines.
func scrape(ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("scraping %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("scraping %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("scraping %s: %s", url, resp.Status)
	}
	var b strings.Builder
	for line := range strings.Lines(string(body)) {
		if strings.HasPrefix(line, "rabbitretry_") {
			b.WriteString(line)
		}
	}
	return b.String(), nil
}

func containsLine(text, line string) bool {
	for l := range strings.Lines(text) {
		if strings.TrimRight(l, "\n") == line {
			return true
		}
	}
	return false
}

// redactURI returns uri with its password hidden (net/url's URL.Redacted),
// for error messages; a URI that does not parse is not shown.
func redactURI(uri string) string {
	u, err := url.Parse(uri)
	if err != nil {
		return "(unparsable URI)"
	}
	return u.Redacted()
}
