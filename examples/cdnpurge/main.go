// Command cdnpurge is a CDN purge service under a burst it cannot take at
// once. Purge requests published to the exchange "cdn" with routing key
// "purge" land in the queue "cdn.purger"; the purger asks a CDN purge API to
// drop each URL from its caches. The API (an in-process HTTP stub on
// 127.0.0.1) takes at most 20 purges per 500 ms (a token bucket); over that it
// answers 507 "queue is full" to some requests and 429 with Retry-After: 1 to
// others, and 400 to a malformed URL. The purger maps the answers onto the
// retry chain:
//
//	2xx                 -> nil (acked)
//	429 + Retry-After   -> middleware.RetryAfter(err, at least Retry-After)
//	507, 503, other 5xx -> plain error: transient, exponential backoff from
//	                       200 ms, x2, ±50% jitter, capped at 3.2 s
//	400 (other 4xx)     -> middleware.Permanent: poisoned at once
//
// The burst drains at the API's pace; each valid URL is purged exactly once,
// the malformed ones end in cdn.purger.poison, nothing is lost.
//
//	go run ./examples/cdnpurge                       # RabbitMQ at AMQP_URI
//	go run ./examples/cdnpurge -requests 1000 -timeout 2m
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// config is what run needs; main fills it from flags and AMQP_URI.
type config struct {
	URI        string
	Exchange   string // business exchange, "cdn"
	RoutingKey string // "purge"
	Queue      string // the purger's queue (and subscribe topic), "cdn.purger"
	Requests   int    // purge requests published in one burst
	Timeout    time.Duration
	// Handlers is the number of router handlers subscribed to Queue. A
	// watermill-amqp subscription hands its messages to the handler one at a
	// time (the next delivery waits for the previous ack or nack), so the
	// purger gets its concurrency from N handlers on the same topic: N AMQP
	// channels, N consumers on one queue, each with its own prefetch.
	Handlers int
	Prefetch int // per consumer (channel)

	// The CDN stub: Burst purges per Window (a token bucket), and the
	// Retry-After it sends with a 429.
	Burst      int
	Window     time.Duration
	RetryAfter time.Duration

	// MalformedEvery: every n-th request carries a malformed URL.
	MalformedEvery int
	// MaxAttempts is generous on purpose: a valid URL must never be given up
	// because the CDN was busy (it would be poisoned, and stay cached).
	MaxAttempts int

	Out io.Writer // progress and summary
}

func defaultConfig() config {
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5672/"
	}
	return config{
		URI: uri, Exchange: "cdn", RoutingKey: "purge", Queue: "cdn.purger",
		Requests: 300, Timeout: 90 * time.Second, Handlers: 4, Prefetch: 64,
		Burst: 20, Window: 500 * time.Millisecond, RetryAfter: time.Second,
		MalformedEvery: 25, MaxAttempts: 20, Out: os.Stdout,
	}
}

// backoffPolicy: 200 ms, 400 ms, 800 ms, 1.6 s, 3.2 s, 3.2 s... each with ±50%
// jitter, never stopping (MaxAttempts ends the retries).
func backoffPolicy() backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 200 * time.Millisecond
	b.RandomizationFactor = 0.5
	b.Multiplier = 2
	b.MaxInterval = 3200 * time.Millisecond
	b.MaxElapsedTime = 0
	b.Reset()
	return b
}

// tiers are the wait queues. The doubling ones cover the backoff (TierFor
// picks the nearest tier on a log scale, so a jittered delay lands within a
// factor 1.41 of itself). 1 s is there for the 429s: without it a 1 s
// Retry-After would wait 1.6 s, since a RetryAfter delay is rounded up to a
// tier, never down (amqpretry rounds a RetryAfter up to the next tier).
var tiers = []time.Duration{
	200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond,
	time.Second, 1600 * time.Millisecond, 3200 * time.Millisecond,
}

// ---------------------------------------------------------------------------
// The CDN purge API stub.

type purgeRequest struct {
	URL string `json:"url"`
}

// cdnStub is the purge API: a token bucket of burst tokens refilled at
// burst/window. It keeps the truth the summary checks: purges per URL, and
// retries that came back before the Retry-After it asked for.
type cdnStub struct {
	burst, rate float64 // tokens, tokens per second
	retryAfter  time.Duration

	mu        sync.Mutex
	tokens    float64
	last      time.Time
	rejected  int
	purged    map[string]int
	notBefore map[string]time.Time // URL -> end of the Retry-After it was given
	early     int                  // requests that came back before their Retry-After
	n2xx      int
	n429      int
	n507      int
	n400      int
}

func newCDNStub(burst int, window, retryAfter time.Duration) *cdnStub {
	return &cdnStub{
		burst: float64(burst), rate: float64(burst) / window.Seconds(), retryAfter: retryAfter,
		tokens: float64(burst), last: time.Now(), purged: map[string]int{}, notBefore: map[string]time.Time{},
	}
}

// validURL is the API's check: an absolute http(s) URL with a host.
func validURL(s string) bool {
	u, err := url.Parse(s)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""
}

func (c *cdnStub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/purge" {
		http.NotFound(w, r)
		return
	}
	var req purgeRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&req); err != nil || !validURL(req.URL) {
		c.mu.Lock()
		c.n400++
		c.mu.Unlock()
		http.Error(w, fmt.Sprintf("malformed url %q", req.URL), http.StatusBadRequest)
		return
	}
	now := time.Now()
	c.mu.Lock()
	if nb, ok := c.notBefore[req.URL]; ok {
		if now.Before(nb) {
			c.early++
		}
		delete(c.notBefore, req.URL)
	}
	c.tokens = min(c.burst, c.tokens+now.Sub(c.last).Seconds()*c.rate)
	c.last = now
	if c.tokens >= 1 {
		c.tokens--
		c.purged[req.URL]++
		c.n2xx++
		c.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"status":"purged"}`)
		return
	}
	// Over the limit: every other refusal is a 507 without Retry-After, the
	// others a 429 asking to come back in retryAfter.
	c.rejected++
	if c.rejected%2 == 1 {
		c.n507++
		c.mu.Unlock()
		http.Error(w, "queue is full", http.StatusInsufficientStorage)
		return
	}
	c.n429++
	c.notBefore[req.URL] = now.Add(c.retryAfter)
	c.mu.Unlock()
	w.Header().Set("Retry-After", strconv.Itoa(int((c.retryAfter+time.Second-1)/time.Second)))
	http.Error(w, "too many purge requests", http.StatusTooManyRequests)
}

// counts is a snapshot of the stub's answers.
type counts struct{ purged, n2xx, n429, n507, n400, early int }

func (c *cdnStub) snapshot() counts {
	c.mu.Lock()
	defer c.mu.Unlock()
	return counts{purged: len(c.purged), n2xx: c.n2xx, n429: c.n429, n507: c.n507, n400: c.n400, early: c.early}
}

// ---------------------------------------------------------------------------
// The purger: the handler and its view of the outcome.

// cdnError is a non-2xx answer of the purge API.
type cdnError struct {
	Status int
	Body   string
}

func (e *cdnError) Error() string {
	return fmt.Sprintf("cdn purge: %d %s: %s", e.Status, http.StatusText(e.Status), e.Body)
}

type purger struct {
	endpoint string
	client   *http.Client
	tiers    []time.Duration
}

// parseRetryAfter reads a Retry-After header: delay-seconds or an HTTP-date.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if s, err := strconv.Atoi(v); err == nil && s >= 0 {
		return time.Duration(s) * time.Second, true
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

func (p *purger) handle(msg *message.Message) error {
	var req purgeRequest
	if err := json.Unmarshal(msg.Payload, &req); err != nil {
		return fmt.Errorf("decoding purge request: %w", err) // *json.SyntaxError: poisoned as malformed
	}
	ctx, cancel := context.WithTimeout(msg.Context(), 5*time.Second)
	defer cancel()
	body, err := json.Marshal(req)
	if err != nil {
		return middleware.Permanent(err)
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, p.endpoint, bytes.NewReader(body))
	if err != nil {
		return middleware.Permanent(err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := p.client.Do(hreq)
	if err != nil {
		return fmt.Errorf("cdn purge %s: %w", req.URL, err) // network trouble: transient
	}
	defer resp.Body.Close()
	text, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	cerr := &cdnError{Status: resp.StatusCode, Body: strings.TrimSpace(string(text))}
	switch s := resp.StatusCode; {
	case s >= 200 && s < 300:
		return nil
	case s == http.StatusTooManyRequests:
		if d, ok := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()); ok && d > 0 {
			return middleware.RetryAfter(cerr, d)
		}
		return cerr // no usable Retry-After: backoff
	case s >= 500, s == http.StatusRequestTimeout:
		return cerr // 507 queue is full, 503, ...: transient, backoff with jitter
	default:
		return middleware.Permanent(cerr) // 400 malformed URL and other 4xx: retrying cannot help
	}
}

// ---------------------------------------------------------------------------
// Accounting.

// tally is what the retry chain reported (Observer) plus what was published.
type tally struct {
	mu        sync.Mutex
	urlOf     map[string]string // message UUID -> URL
	malformed map[string]bool   // URL -> published malformed on purpose
	retries   map[int]int       // attempt number -> retries scheduled after it
	nRetries  int
	poisoned  map[string]string // URL -> "class after n attempt(s)"
	failed    int               // RetryFailed + PoisonFailed (nacked, dead-lettered, not lost)
	dropped   int
}

func newTally() *tally {
	return &tally{urlOf: map[string]string{}, malformed: map[string]bool{}, retries: map[int]int{}, poisoned: map[string]string{}}
}

type observer struct{ t *tally }

func (o observer) RetryScheduled(_ *message.Message, attempt int, _, _ time.Duration) {
	o.t.mu.Lock()
	o.t.retries[attempt]++
	o.t.nRetries++
	o.t.mu.Unlock()
}

func (o observer) RetryFailed(*message.Message, int, error) {
	o.t.mu.Lock()
	o.t.failed++
	o.t.mu.Unlock()
}

func (o observer) Poisoned(msg *message.Message, attempt int, class string) {
	o.t.mu.Lock()
	o.t.poisoned[o.t.urlOf[msg.UUID]] = fmt.Sprintf("%s after %d attempt(s)", class, attempt)
	o.t.mu.Unlock()
}

func (o observer) PoisonFailed(*message.Message, int, error) {
	o.t.mu.Lock()
	o.t.failed++
	o.t.mu.Unlock()
}

func (o observer) Dropped(*message.Message, int) {
	o.t.mu.Lock()
	o.t.dropped++
	o.t.mu.Unlock()
}

// summary is the outcome of a run.
type summary struct {
	Published, Valid, Malformed int
	PurgedOnce                  int // valid URLs purged exactly once at the CDN
	Duplicates                  int // URLs purged more than once
	MalformedPurged             int // malformed URLs the CDN purged (must be 0)
	Poisoned                    int // URLs in the poison queue per the Observer
	PoisonedMalformed           int // of them, malformed ones poisoned as permanent after attempt 1
	ValidPoisoned               []string
	Lost                        int // neither purged nor poisoned
	N2xx, N429, N507, N400      int // CDN answers
	Early                       int // retries that came back before the CDN's Retry-After
	Retries                     int
	RetriesByAttempt            map[int]int
	Failed                      int // retry or poison publishes that failed (nacked)
	LeftInQueues                int // ready in the queue and its wait queues after the run
	PoisonQueueDepth            int
	Took                        time.Duration
}

// check returns nil when the accounting adds up.
func (s *summary) check() error {
	var bad []string
	if s.Published == 0 {
		bad = append(bad, "nothing published")
	}
	if s.PurgedOnce != s.Valid || s.Duplicates != 0 || s.MalformedPurged != 0 {
		bad = append(bad, fmt.Sprintf("purged exactly once %d of %d valid, %d duplicates, %d malformed purged",
			s.PurgedOnce, s.Valid, s.Duplicates, s.MalformedPurged))
	}
	if s.PoisonedMalformed != s.Malformed || s.Poisoned != s.Malformed {
		bad = append(bad, fmt.Sprintf("poisoned %d (%d malformed as permanent after attempt 1) of %d malformed; valid poisoned: %v",
			s.Poisoned, s.PoisonedMalformed, s.Malformed, s.ValidPoisoned))
	}
	if s.Lost != 0 {
		bad = append(bad, fmt.Sprintf("lost %d", s.Lost))
	}
	if s.Early != 0 {
		bad = append(bad, fmt.Sprintf("%d retries came back before their Retry-After", s.Early))
	}
	if s.LeftInQueues != 0 || s.PoisonQueueDepth != s.Malformed {
		bad = append(bad, fmt.Sprintf("%d messages left in the queue and wait queues, poison queue holds %d (want %d)",
			s.LeftInQueues, s.PoisonQueueDepth, s.Malformed))
	}
	if len(bad) > 0 {
		return errors.New("the accounting does not add up: " + strings.Join(bad, "; "))
	}
	return nil
}

func (s *summary) print(w io.Writer) {
	fmt.Fprintln(w)
	fmt.Fprintln(w, "== summary")
	fmt.Fprintf(w, "purge requests published:  %d (%d valid URLs, %d malformed)\n", s.Published, s.Valid, s.Malformed)
	fmt.Fprintf(w, "purged exactly once:       %d of %d valid (%d purged twice or more)\n", s.PurgedOnce, s.Valid, s.Duplicates)
	fmt.Fprintf(w, "poisoned:                  %d (%d malformed, permanent after attempt 1)\n", s.Poisoned, s.PoisonedMalformed)
	fmt.Fprintf(w, "CDN answers:               2xx %d, 429 %d, 507 %d, 400 %d\n", s.N2xx, s.N429, s.N507, s.N400)
	fmt.Fprintf(w, "back before Retry-After:   %d\n", s.Early)
	fmt.Fprintf(w, "retries scheduled:         %d", s.Retries)
	if s.Failed > 0 {
		fmt.Fprintf(w, " (%d retry/poison publishes failed and were nacked)", s.Failed)
	}
	fmt.Fprintln(w)
	attempts := make([]int, 0, len(s.RetriesByAttempt))
	for a := range s.RetriesByAttempt {
		attempts = append(attempts, a)
	}
	sort.Ints(attempts)
	for _, a := range attempts {
		fmt.Fprintf(w, "  after attempt %2d:        %d\n", a, s.RetriesByAttempt[a])
	}
	fmt.Fprintf(w, "left in queue + wait:      %d (poison queue: %d)\n", s.LeftInQueues, s.PoisonQueueDepth)
	fmt.Fprintf(w, "total time:                %v\n", s.Took.Round(time.Millisecond))
	fmt.Fprintf(w, "lost: %d\n", s.Lost)
}

// ---------------------------------------------------------------------------
// The run.

func main() {
	cfg := defaultConfig()
	flag.IntVar(&cfg.Requests, "requests", cfg.Requests, "purge requests to publish in one burst")
	flag.DurationVar(&cfg.Timeout, "timeout", cfg.Timeout, "give up waiting after this long")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	s, err := run(ctx, cfg)
	if s != nil {
		s.print(cfg.Out)
	}
	if err == nil && s != nil {
		err = s.check()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cdnpurge:", err)
		os.Exit(1)
	}
}

// run publishes cfg.Requests purge requests at once and waits until each is
// purged or poisoned. The summary is returned whenever the run got as far as
// publishing, also with an error (e.g. the timeout); check it with
// summary.check.
func run(ctx context.Context, cfg config) (*summary, error) {
	if cfg.Requests < 1 || cfg.Handlers < 1 {
		return nil, fmt.Errorf("need at least 1 request and 1 handler, got %d and %d", cfg.Requests, cfg.Handlers)
	}
	out := cfg.Out
	if out == nil {
		out = io.Discard
	}
	logger := errorLogger{w: out}

	stub := newCDNStub(cfg.Burst, cfg.Window, cfg.RetryAfter)
	srv := httptest.NewServer(stub) // listens on 127.0.0.1
	defer srv.Close()
	p := &purger{
		endpoint: srv.URL + "/purge",
		client:   &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 2 * cfg.Handlers}},
		tiers:    slices.Sorted(slices.Values(tiers)),
	}
	defer p.client.CloseIdleConnections()

	subCfg := wamqp.NewDurableQueueConfig(cfg.URI)
	subCfg.Exchange = wamqp.ExchangeConfig{
		GenerateName: func(string) string { return cfg.Exchange }, Type: "direct", Durable: true,
	}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return cfg.RoutingKey }}
	subCfg.Consume.Qos.PrefetchCount = cfg.Prefetch // per channel, i.e. per handler

	t := newTally()
	retry, err := amqpretry.New(amqpretry.Config{
		URI: cfg.URI, Subscriber: subCfg, Policy: router.Policy{MaxAttempts: cfg.MaxAttempts, Backoff: backoffPolicy, Observer: observer{t: t}}, Mode: amqpretry.Tiers(tiers...),
		Logger: logger,
	})
	if err != nil {
		return nil, fmt.Errorf("%w (is RabbitMQ up? scripts/ensure-broker.sh)", err)
	}
	defer retry.Close()
	topo := retry.Topology()
	waitQueues := topo.WaitQueues(cfg.Queue)
	if err := retry.DeleteQueues(cfg.Queue); err != nil { // start from zero
		return nil, err
	}
	fmt.Fprintf(out, "CDN stub at %s: %d purges per %v, 429 Retry-After %v or 507 when over, 400 for a malformed URL\n",
		srv.URL, cfg.Burst, cfg.Window, cfg.RetryAfter)
	fmt.Fprintf(out, "queue %s: %d handlers x prefetch %d; retry tiers %v; backoff 200ms x2 ±50%% (cap 3.2s); max attempts %d\n",
		cfg.Queue, cfg.Handlers, cfg.Prefetch, topo.Tiers(), cfg.MaxAttempts)

	sub, err := retry.NewSubscriber(logger, 0) // drains in-flight handlers on shutdown
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	pubCfg := wamqp.NewDurableQueueConfig(cfg.URI)
	pubCfg.Exchange = subCfg.Exchange
	pubCfg.Publish.GenerateRoutingKey = func(string) string { return cfg.RoutingKey }
	pubCfg.Publish.ConfirmDelivery = true
	pub, err := wamqp.NewPublisher(pubCfg, logger)
	if err != nil {
		return nil, err
	}
	defer pub.Close()

	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return nil, err
	}
	r.AddMiddleware(retry.Middleware, wmw.Recoverer)
	// One purge handler, N times on the same topic: watermill-amqp runs one
	// message at a time per subscription, so N distinct handler names on
	// cfg.Queue give N consumers (N AMQP channels) and N purges in flight.
	for i := 1; i <= cfg.Handlers; i++ {
		r.AddConsumerHandler(fmt.Sprintf("purger-%d", i), cfg.Queue, sub, p.handle)
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(rctx) }()
	select {
	case <-r.Running():
	case err := <-errc:
		return nil, err
	}

	msgs := makeRequests(t, cfg.Requests, cfg.MalformedEvery)
	start := time.Now()
	fmt.Fprintf(out, "%6.1fs  publishing %d purge requests to exchange %q, routing key %q (every %dth URL malformed)\n",
		0.0, len(msgs), cfg.Exchange, cfg.RoutingKey, cfg.MalformedEvery)
	if err := pub.Publish(cfg.Exchange, msgs...); err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("publishing: %w", err)
	}

	waitErr := waitDone(ctx, out, start, cfg.Timeout, stub, t)
	took := time.Since(start)
	if err := r.Close(); err != nil && waitErr == nil {
		waitErr = err
	}
	s := tallyUp(t, stub, took)
	if err := countLeft(cfg.URI, cfg.Queue, waitQueues, topo.Naming().PoisonQueue(cfg.Queue), s); err != nil && waitErr == nil {
		waitErr = err
	}
	return s, waitErr
}

// makeRequests builds n purge requests; every malformedEvery-th URL is one
// the CDN refuses with 400 (three kinds in turn).
func makeRequests(t *tally, n, malformedEvery int) []*message.Message {
	bad := []string{"https://cdn.example.com/assets/%zz-%d.css", "not a url %d", "ftp://cdn.example.com/assets/%d.bin"}
	msgs := make([]*message.Message, 0, n)
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := 1; i <= n; i++ {
		u := fmt.Sprintf("https://cdn.example.com/assets/app-%d.js", i)
		malformed := malformedEvery > 0 && i%malformedEvery == 0
		if malformed {
			u = fmt.Sprintf(bad[(i/malformedEvery-1)%len(bad)], i)
		}
		payload, _ := json.Marshal(purgeRequest{URL: u})
		m := message.NewMessage(watermill.NewUUID(), payload)
		t.urlOf[m.UUID] = u
		t.malformed[u] = malformed
		msgs = append(msgs, m)
	}
	return msgs
}

// done reports whether every URL is purged (valid) or poisoned (malformed,
// or a valid one given up: the summary then reports it).
func done(t *tally, stub *cdnStub) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	stub.mu.Lock()
	defer stub.mu.Unlock()
	for u := range t.malformed {
		if _, p := t.poisoned[u]; !p && stub.purged[u] == 0 {
			return false
		}
	}
	return true
}

// waitDone prints a progress line per second until done or the timeout.
func waitDone(ctx context.Context, out io.Writer, start time.Time, timeout time.Duration, stub *cdnStub, t *tally) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	poll := time.NewTicker(20 * time.Millisecond)
	defer poll.Stop()
	second := time.NewTicker(time.Second)
	defer second.Stop()
	var prevC counts
	var prevRetries, prevPoisoned int
	progress := func() {
		c := stub.snapshot()
		t.mu.Lock()
		retries, poisoned := t.nRetries, len(t.poisoned)
		t.mu.Unlock()
		fmt.Fprintf(out, "%6.1fs  purged %4d (+%3d)  507s +%4d  429s +%4d  retries scheduled +%4d  poisoned +%2d\n",
			time.Since(start).Seconds(), c.purged, c.purged-prevC.purged, c.n507-prevC.n507, c.n429-prevC.n429,
			retries-prevRetries, poisoned-prevPoisoned)
		prevC, prevRetries, prevPoisoned = c, retries, poisoned
	}
	for !done(t, stub) {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline.C:
			progress()
			return fmt.Errorf("not every purge request was accounted for within %v", timeout)
		case <-second.C:
			progress()
		case <-poll.C:
		}
	}
	progress()
	return nil
}

func tallyUp(t *tally, stub *cdnStub, took time.Duration) *summary {
	t.mu.Lock()
	defer t.mu.Unlock()
	stub.mu.Lock()
	defer stub.mu.Unlock()
	s := &summary{
		Published: len(t.urlOf), Poisoned: len(t.poisoned), Retries: t.nRetries, Failed: t.failed,
		RetriesByAttempt: map[int]int{}, N2xx: stub.n2xx, N429: stub.n429, N507: stub.n507, N400: stub.n400,
		Early: stub.early, Took: took,
	}
	for a, n := range t.retries {
		s.RetriesByAttempt[a] = n
	}
	for u, malformed := range t.malformed {
		reason, poisoned := t.poisoned[u]
		n := stub.purged[u]
		if n > 1 {
			s.Duplicates++
		}
		if malformed {
			s.Malformed++
			if n > 0 {
				s.MalformedPurged++
			}
			if reason == middleware.ClassPermanent+" after 1 attempt(s)" {
				s.PoisonedMalformed++
			}
		} else {
			s.Valid++
			if n == 1 {
				s.PurgedOnce++
			}
			if poisoned {
				s.ValidPoisoned = append(s.ValidPoisoned, u+" ("+reason+")")
			}
		}
		if n == 0 && !poisoned {
			s.Lost++
		}
	}
	sort.Strings(s.ValidPoisoned)
	return s
}

// countLeft records how many messages are ready in the queue and its wait
// queues (after the router closed, unacked ones are back to ready), and the
// poison queue's depth.
func countLeft(uri, queue string, waitQueues []string, poisonQueue string, s *summary) error {
	conn, err := amqp.Dial(uri)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	for _, q := range append([]string{queue, poisonQueue}, waitQueues...) {
		info, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		if err != nil {
			return fmt.Errorf("inspecting queue %s: %w", q, err)
		}
		if q == poisonQueue {
			s.PoisonQueueDepth = info.Messages
		} else {
			s.LeftInQueues += info.Messages
		}
	}
	return nil
}

// errorLogger prints errors only: the retry chain logs every retry at Info,
// thousands of lines in this demo.
type errorLogger struct {
	watermill.NopLogger
	w io.Writer
}

func (l errorLogger) Error(msg string, err error, fields watermill.LogFields) {
	fmt.Fprintf(l.w, "ERROR %s: %v %v\n", msg, err, fields)
}

func (l errorLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }
