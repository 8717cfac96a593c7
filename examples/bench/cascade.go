package main

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/cascadecore"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// The "cascade" scenario (issue #12): amqpretry's per-queue tiered wait
// queues against the delay cascade (amqpretry/cascade), side by side on the
// same broker, in four parts:
//
//  1. accuracy: three variants run at the same time, each on its own queue:
//     tiers (amqpretry.Config.Mode = amqpretry.Tiers(cascadeAccuracyTiers...)), the cascade
//     (amqpretry.Config.Mode = cascade.Mode(...)) and
//     scheduled messages (cascade.Publisher with delay.Message(msg,
//     delay.For(d)), read by a raw amqp091 consumer). For each delay band
//     (cascadeBands, 1 s .. 10 min; -cascade-max-delay cuts the list) N
//     messages (-n cascade=N, default 20), in one random interleaving
//     shared by the three; a retry variant's handler fails attempt 1 with
//     middleware.RetryAfter(err, band) (backoff 1 ms, so RetryAfter is the
//     delay) and succeeds on attempt 2. Error = observed - asked.
//  2. hops and publishes per delayed message: level (wait) queues passed,
//     from the routing arithmetic (popcount of the grain count; 1 for a
//     tier) and measured as the x-death entries of the delivered messages;
//     publishes = 1 client publish + 1 broker dead-letter publish per hop.
//  3. scheduling latency and throughput: 1,000 confirmed schedules one at
//     a time (latency p50/p99: what a handler waits per retry), then
//     -n cascade-sched=N (default 20,000) confirmed
//     schedules from -cascade-workers goroutines (default 64) on one
//     amqpretry confirm.Publisher, delays uniform in [1 h, 2 h): to a tier's
//     wait queue (what amqpretry's Delayer does: marshal, publish to the
//     wait exchange, confirm) vs the cascade Delayer's Schedule; each with its
//     default queue type (tiers: classic wait queues, cascade: quorum
//     levels) and with the other one (variants tiers-quorum,
//     cascade-classic), to tell the topology's cost from the queue type's.
//     Three rounds, variants rotated, queues purged after each; medians.
//  4. memory: variant by variant, -n cascade-mem=N (default 100,000)
//     messages scheduled and left waiting: broker queue memory
//     (rabbitmqctl list_queues), node memory (rabbitmqctl status) before
//     and after, and this process's RSS / heap after a GC, for the tiers'
//     1 h and 2 h wait queues vs the cascade's levels; then purged, and
//     everything deleted at the end.
//
// Duration: the accuracy part waits for its longest tier (10 min with the
// default bands), so the scenario takes about 12 minutes (700 s measured on
// 2 cores with RabbitMQ 4.3.6), more than the 5-minute budget of the
// default list, so it runs only when named (-scenarios cascade). Develop
// with -cascade-max-delay 20s -n cascade=5,cascade-sched=2000,cascade-mem=10000.

// cascadeBands are the asked delays (RetryAfter / delay.For) of the
// accuracy part.
var cascadeBands = []time.Duration{
	time.Second, 1700 * time.Millisecond, 3 * time.Second, 7 * time.Second, 13 * time.Second,
	37 * time.Second, 61 * time.Second, 100 * time.Second, 4 * time.Minute, 10 * time.Minute,
}

// cascadeAccuracyTiers is the tier set of the tiers variant: the default
// backoff's doubling tiers extended to 32 s, then round operator values up
// to 10 min (10 wait queues per originating queue). amqpretry's default
// tiers (1/2/4/8 s for MaxAttempts 5) would clamp every RetryAfter above
// 8 s to 8 s, i.e. come back early.
var cascadeAccuracyTiers = []time.Duration{
	time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second,
	time.Minute, 2 * time.Minute, 5 * time.Minute, 10 * time.Minute,
}

// cascadeMemTiers are the wait queues of the tiers variant in parts 3 and
// 4; delays uniform in [cascadeMemMin, 2×cascadeMemMin) go to the nearest
// (log scale), so nothing expires while measured.
var cascadeMemTiers = []time.Duration{time.Hour, 2 * time.Hour}

const cascadeMemMin = time.Hour

// cascadeFillVariants are the variants of parts 3 and 4: each default
// (tiers on classic wait queues, the cascade on quorum levels) and the
// other queue type, to tell the topology's cost from the queue type's.
var cascadeFillVariants = []string{"tiers", "tiers-quorum", "cascade", "cascade-classic"}

var cascadeVariantType = map[string]string{"tiers": "classic", "tiers-quorum": "quorum", "cascade": "quorum", "cascade-classic": "classic"}

type cascadeOpts struct {
	maxDelay time.Duration
	parts    []string
	workers  int
}

var cascadeParts = []string{"accuracy", "sched", "memory"}

type cascadeDelayStats struct {
	Variant  string  `json:"variant"` // tiers, cascade, scheduled
	AskedMs  int64   `json:"asked_ms"`
	WaitMs   int64   `json:"wait_ms"` // what the topology waits: the tier, or the delay rounded up to the grain
	Messages int     `json:"messages"`
	P50Ms    float64 `json:"error_p50_ms"` // observed - asked
	P99Ms    float64 `json:"error_p99_ms"`
	MaxMs    float64 `json:"error_max_ms"`
	MinMs    float64 `json:"error_min_ms"`
	// Lateness beyond what the topology waits (observed - WaitMs), p99.
	BeyondWaitP99Ms float64 `json:"beyond_wait_p99_ms"`
	HopsComputed    int     `json:"hops_computed"`
	XDeathMean      float64 `json:"xdeath_entries_mean"`
	XDeathMax       int     `json:"xdeath_entries_max"`
}

type cascadeHops struct {
	Variant        string  `json:"variant"`
	Sample         string  `json:"sample"`
	HopsMean       float64 `json:"hops_mean"`
	HopsMax        int     `json:"hops_max"`
	PublishesMean  float64 `json:"publishes_mean"` // client publish + broker dead-letter publishes
	PublishesMax   int     `json:"publishes_max"`
	XDeathMean     float64 `json:"xdeath_entries_mean,omitempty"`
	XDeathMax      int     `json:"xdeath_entries_max,omitempty"`
	XDeathMessages int     `json:"xdeath_messages,omitempty"`
}

type cascadeSched struct {
	Variant  string    `json:"variant"`
	Messages int       `json:"messages"`
	Workers  int       `json:"workers"`
	Rounds   int       `json:"rounds"`
	RatePerS float64   `json:"rate_per_s"` // median over the rounds
	Rates    []float64 `json:"rates_per_s"`
	// One goroutine, one schedule at a time (before the parallel phase of
	// each round): what one handler waits per retry; latency percentiles
	// over all rounds, rate the median.
	SerialMessages int     `json:"serial_messages"`
	SerialRatePerS float64 `json:"serial_rate_per_s"`
	SerialP50Ms    float64 `json:"serial_latency_p50_ms"`
	SerialP99Ms    float64 `json:"serial_latency_p99_ms"`
}

type cascadeMem struct {
	Variant      string      `json:"variant"`
	FillRatePerS float64     `json:"fill_rate_per_s"`
	Waiting      int64       `json:"waiting_messages"` // list_queues messages, summed
	Queues       int         `json:"queues_holding"`   // queues with messages
	QueueMiB     float64     `json:"queue_memory_mib"` // list_queues memory, summed over the variant's queues
	NodeBefore   *nodeMemory `json:"broker_node_before,omitempty"`
	NodeAfter    *nodeMemory `json:"broker_node_waiting,omitempty"`
	ClientBefore memSample   `json:"client_before_after_gc"`
	ClientAfter  memSample   `json:"client_waiting_after_gc"`
	Levels       string      `json:"levels,omitempty"` // cascade: messages per level queue
}

type cascadeResult struct {
	Bands     []int64             `json:"bands_ms"`
	PerBand   int                 `json:"messages_per_band"`
	Tiers     []int64             `json:"accuracy_tiers_ms"`
	MemTiers  []int64             `json:"memory_tiers_ms"`
	GrainMs   int64               `json:"cascade_grain_ms"`
	Levels    int                 `json:"cascade_levels"`
	LevelType string              `json:"cascade_queue_type"`
	Accuracy  []cascadeDelayStats `json:"accuracy,omitempty"`
	AccuracyS float64             `json:"accuracy_s,omitempty"`
	Hops      []cascadeHops       `json:"hops,omitempty"`
	Sched     []cascadeSched      `json:"scheduling,omitempty"`
	Memory    []cascadeMem        `json:"memory,omitempty"`
	Probe     *cascadeProbe       `json:"routing_probe,omitempty"`
}

// cascadeCore is c as the cascade's machinery takes it (names, MaxDelay,
// the raw Delayer): the bench measures below the public API.
func cascadeCore(c cascade.Config) cascadecore.Config {
	return cascadecore.Config{Prefix: c.Prefix, Grain: c.Grain, Levels: c.Levels, QueueType: c.QueueType,
		Publisher: c.Publisher, URI: c.URI, Marshaler: c.Marshaler, QueueName: c.QueueName, Logger: c.Logger,
		TopologyCheck: c.TopologyCheck, ManagementURL: c.ManagementURL, Vhost: c.Vhost, FullWait: c.FullWait}
}

// cascadeConfig is the bench's cascade: the defaults, under the run's
// prefix, so cleanup removes it and nobody else's cascade is touched.
func (e *env) cascadeConfig(queueType string) (cascade.Config, int) {
	cc := cascade.Config{Prefix: e.name("cascade", queueType), Logger: e.logger, QueueType: queueType}
	core := cascadeCore(cc)
	md, _ := core.MaxDelay()
	levels := bits.Len64(uint64(md / cascadecore.DefaultGrain))
	for n := range levels {
		e.trackQueues(core.LevelName(n))
		e.trackExchanges(core.LevelName(n))
	}
	e.trackExchanges(core.DeliveryExchange())
	return cc, levels
}

func (b *bench) scenarioCascade() error {
	o := b.cascade
	_, levels := b.env.cascadeConfig(amqpretry.QueueTypeQuorum)
	res := &cascadeResult{PerBand: b.size("cascade", 20), GrainMs: cascadecore.DefaultGrain.Milliseconds(), Levels: levels, LevelType: amqpretry.QueueTypeQuorum}
	for _, d := range cascadeBands {
		if d <= o.maxDelay {
			res.Bands = append(res.Bands, d.Milliseconds())
		}
	}
	for _, t := range cascadeAccuracyTiers {
		res.Tiers = append(res.Tiers, t.Milliseconds())
	}
	for _, t := range cascadeMemTiers {
		res.MemTiers = append(res.MemTiers, t.Milliseconds())
	}
	b.summary.Cascade = res
	sc := "7 tiers vs cascade"
	b.row(sc, "setup", fmt.Sprintf("tiers: per-queue classic wait queues (accuracy tiers %s); cascade: %d quorum levels, %v grain, shared", fmtDurs(cascadeAccuracyTiers), levels, cascadecore.DefaultGrain), "", "")
	var errs []error
	if slices.Contains(o.parts, "accuracy") {
		if len(res.Bands) == 0 {
			errs = append(errs, fmt.Errorf("-cascade-max-delay %v leaves no band (shortest %v)", o.maxDelay, cascadeBands[0]))
		} else if err := b.cascadeAccuracy(res); err != nil {
			errs = append(errs, fmt.Errorf("accuracy: %w", err))
		}
	}
	if slices.Contains(o.parts, "sched") || slices.Contains(o.parts, "memory") {
		if err := b.cascadeFill(res); err != nil {
			errs = append(errs, fmt.Errorf("scheduling/memory: %w", err))
		}
	}
	if slices.Contains(o.parts, "sched") {
		if err := b.cascadeRoutingProbe(res, b.size("cascade-sched", 20000)); err != nil {
			errs = append(errs, fmt.Errorf("routing probe: %w", err))
		}
	}
	b.cascadeRows(res)
	return errors.Join(errs...)
}

// cascadeObs is one delivered delayed message.
type cascadeObs struct {
	asked    time.Duration
	observed time.Duration
	xdeath   int
}

type cascadeCollector struct {
	mu       sync.Mutex
	failedAt map[string]time.Time
	obs      []cascadeObs
	tr       *tracker
}

func newCascadeCollector(n int) *cascadeCollector {
	return &cascadeCollector{failedAt: map[string]time.Time{}, tr: newTracker(n)}
}

func (c *cascadeCollector) add(o cascadeObs) {
	c.mu.Lock()
	c.obs = append(c.obs, o)
	c.mu.Unlock()
	c.tr.hit()
}

// retryHandler fails attempt 1 with RetryAfter(asked) and records attempt
// 2: observed = its start - the moment attempt 1 returned its error.
func (c *cascadeCollector) retryHandler(msg *message.Message) error {
	now := time.Now()
	askedMs, _ := strconv.ParseInt(msg.Metadata.Get(hdrTierMs), 10, 64)
	asked := time.Duration(askedMs) * time.Millisecond
	if middleware.Attempt(msg) == 1 {
		c.mu.Lock()
		c.failedAt[msg.UUID] = time.Now()
		c.mu.Unlock()
		return middleware.RetryAfter(errTransient, asked)
	}
	c.mu.Lock()
	t0, ok := c.failedAt[msg.UUID]
	delete(c.failedAt, msg.UUID)
	c.mu.Unlock()
	if !ok {
		return nil // a duplicate: counted once
	}
	recs, _ := amqpwire.ParseXDeath(msg.Metadata.Get(middleware.XDeathKey))
	c.add(cascadeObs{asked: asked, observed: now.Sub(t0), xdeath: len(recs)})
	return nil
}

// cascadeAccuracy runs part 1: tiers, cascade and scheduled variants at
// the same time.
func (b *bench) cascadeAccuracy(res *cascadeResult) (err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	cc, _ := e.cascadeConfig(amqpretry.QueueTypeQuorum)
	per := res.PerBand
	var asked []time.Duration
	for _, ms := range res.Bands {
		for range per {
			asked = append(asked, time.Duration(ms)*time.Millisecond)
		}
	}
	rng := rand.New(rand.NewPCG(12, 5)) // one fixed interleaving, the same for the three variants
	rng.Shuffle(len(asked), func(i, j int) { asked[i], asked[j] = asked[j], asked[i] })
	n := len(asked)
	mk := func(i int) amqp.Publishing {
		return benchPublishing(i, amqp.Table{hdrTierMs: strconv.FormatInt(asked[i].Milliseconds(), 10)})
	}
	constant := func() backoff.BackOff { return backoff.NewConstantBackOff(time.Millisecond) }
	subCfg := func() wamqp.Config {
		c := wamqp.NewDurableQueueConfig(e.uri)
		c.Consume.Qos.PrefetchCount = 256
		return c
	}

	// tiers
	qT := e.name("cas", "tiers", watermillShort())
	retryT, subT, closeT, err := e.retryConsumer(amqpretry.Config{Subscriber: subCfg(), Naming: e.naming("cas-tiers"), Logger: e.logger,
		Mode: amqpretry.Tiers(cascadeAccuracyTiers...), Policy: router.Policy{Backoff: constant}}, qT)
	if err != nil {
		return err
	}
	defer closeT()
	colT := newCascadeCollector(n)
	rrT, err := e.startRouter(consumer{sub: subT, topic: qT, handlers: 4, middlewares: []message.HandlerMiddleware{retryT.Middleware}, handler: colT.retryHandler})
	if err != nil {
		return err
	}
	defer func() { _ = rrT.close() }()

	// cascade
	qC := e.name("cas", "cascade", watermillShort())
	retryC, subC, closeC, err := e.retryConsumer(amqpretry.Config{Subscriber: subCfg(), Naming: e.naming("cas-cascade"), Logger: e.logger,
		Mode: cascade.Mode(cc), Policy: router.Policy{Backoff: constant}}, qC)
	if err != nil {
		return err
	}
	defer closeC()
	colC := newCascadeCollector(n)
	rrC, err := e.startRouter(consumer{sub: subC, topic: qC, handlers: 4, middlewares: []message.HandlerMiddleware{retryC.Middleware}, handler: colC.retryHandler})
	if err != nil {
		return err
	}
	defer func() { _ = rrC.close() }()

	// scheduled messages: cascade.Publisher -> a plain durable queue, read raw
	qS := e.name("cas", "scheduled", watermillShort())
	e.trackQueues(qS)
	ch, err := e.channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	if _, err := ch.QueueDeclare(qS, true, false, false, false, nil); err != nil {
		return err
	}
	pcfg := cc
	pcfg.URI = e.uri
	pub, err := cascade.NewPublisher(pcfg)
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	if err := pub.Bind(qS); err != nil {
		return err
	}
	deliveries, err := ch.Consume(qS, "", true, false, false, false, nil)
	if err != nil {
		return err
	}
	colS := newCascadeCollector(n)
	go func() {
		for d := range deliveries {
			now := time.Now()
			askedMs, _ := strconv.ParseInt(fmt.Sprint(d.Headers[hdrTierMs]), 10, 64)
			markNs, _ := strconv.ParseInt(fmt.Sprint(d.Headers[hdrPublishedNs]), 10, 64)
			xd, _ := d.Headers["x-death"].([]any)
			colS.add(cascadeObs{asked: time.Duration(askedMs) * time.Millisecond, observed: now.Sub(time.Unix(0, markNs)), xdeath: len(xd)})
		}
	}()

	logf("cascade accuracy: %d messages per variant (%d per band, bands %s), tiers %s", n, per, fmtDurs(msDurs(res.Bands)), fmtDurs(cascadeAccuracyTiers))
	start := time.Now()
	var wg sync.WaitGroup
	pubErrs := make([]error, 3)
	wg.Go(func() { pubErrs[0] = e.fillPaced(qT, 0, n, mk) })
	wg.Go(func() { pubErrs[1] = e.fillPaced(qC, 0, n, mk) })
	wg.Go(func() {
		// paced like fillPaced: 10 messages every 50 ms
		for i, d := range asked {
			msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"id":%d,"pad":"%s"}`, i, padding))
			msg.Metadata.Set(hdrTierMs, strconv.FormatInt(d.Milliseconds(), 10))
			msg.Metadata.Set(hdrPublishedNs, strconv.FormatInt(time.Now().UnixNano(), 10)) // the moment of marking: the delay counts from here
			delay.Message(msg, delay.For(d))
			if err := pub.Publish(qS, msg); err != nil {
				pubErrs[2] = err
				return
			}
			if i%10 == 9 {
				time.Sleep(50 * time.Millisecond) // pacing the publisher, not synchronisation
			}
		}
	})
	wg.Wait()
	if err := errors.Join(pubErrs...); err != nil {
		return err
	}
	longest := slices.Max(cascadeAccuracyTiers)
	maxAsked := slices.Max(asked)
	tierWait := func(d time.Duration) time.Duration {
		i, _ := slices.BinarySearch(cascadeAccuracyTiers, d)
		if i == len(cascadeAccuracyTiers) {
			return longest
		}
		return cascadeAccuracyTiers[i]
	}
	timeout := max(tierWait(maxAsked), maxAsked) + 2*time.Minute
	var werrs [3]error
	var wg2 sync.WaitGroup
	for i, c := range []*cascadeCollector{colT, colC, colS} {
		wg2.Go(func() { werrs[i] = c.tr.wait(timeout, []string{"tiers", "cascade", "scheduled"}[i]) })
	}
	wg2.Wait()
	res.AccuracyS = time.Since(start).Seconds()
	if err := errors.Join(werrs[:]...); err != nil {
		return err
	}
	grainWait := func(d time.Duration) time.Duration {
		g := cascadecore.DefaultGrain
		return (d + g - 1) / g * g
	}
	grains := func(d time.Duration) uint64 { return uint64(grainWait(d) / cascadecore.DefaultGrain) }
	for vi, c := range []*cascadeCollector{colT, colC, colS} {
		variant := []string{"tiers", "cascade", "scheduled"}[vi]
		byBand := map[int64][]cascadeObs{}
		for _, o := range c.obs {
			byBand[o.asked.Milliseconds()] = append(byBand[o.asked.Milliseconds()], o)
		}
		var hops cascadeHops
		hops.Variant, hops.Sample = variant, "accuracy bands"
		var hopSum, xdSum, cnt int
		for _, ms := range res.Bands {
			d := time.Duration(ms) * time.Millisecond
			obs := byBand[ms]
			wait, hop := grainWait(d), bits.OnesCount64(grains(d))
			if variant == "tiers" {
				wait, hop = tierWait(d), 1
			}
			errs := make([]time.Duration, 0, len(obs))
			beyond := make([]time.Duration, 0, len(obs))
			st := cascadeDelayStats{Variant: variant, AskedMs: ms, WaitMs: wait.Milliseconds(), Messages: len(obs), HopsComputed: hop}
			for _, o := range obs {
				errs = append(errs, o.observed-d)
				beyond = append(beyond, o.observed-wait)
				st.XDeathMean += float64(o.xdeath)
				st.XDeathMax = max(st.XDeathMax, o.xdeath)
				xdSum += o.xdeath
				hopSum += hop
				cnt++
				hops.HopsMax = max(hops.HopsMax, hop)
				hops.XDeathMax = max(hops.XDeathMax, o.xdeath)
			}
			if len(obs) > 0 {
				st.XDeathMean /= float64(len(obs))
			}
			slices.Sort(errs)
			slices.Sort(beyond)
			st.P50Ms, st.P99Ms, st.MaxMs, st.MinMs = ms2(percentile(errs, 50)), ms2(percentile(errs, 99)), ms2(percentile(errs, 100)), ms2(percentile(errs, 0))
			st.BeyondWaitP99Ms = ms2(percentile(beyond, 99))
			res.Accuracy = append(res.Accuracy, st)
		}
		if cnt > 0 {
			hops.HopsMean = float64(hopSum) / float64(cnt)
			hops.XDeathMean = float64(xdSum) / float64(cnt)
		}
		hops.XDeathMessages = cnt
		hops.PublishesMean, hops.PublishesMax = 1+hops.HopsMean, 1+hops.HopsMax
		res.Hops = append(res.Hops, hops)
	}
	logf("cascade accuracy: done in %.0f s", res.AccuracyS)
	return nil
}

func ms2(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func msDurs(ms []int64) []time.Duration {
	out := make([]time.Duration, len(ms))
	for i, m := range ms {
		out[i] = time.Duration(m) * time.Millisecond
	}
	return out
}

func fmtDurs(ds []time.Duration) string {
	s := make([]string, len(ds))
	for i, d := range ds {
		s[i] = fmtDur(d)
	}
	return strings.Join(s, "/")
}

// retryLikeMessage is a retry copy as the chain schedules it: attempt 2,
// failure metadata, origin queue.
func retryLikeMessage(i int, origin string, d time.Duration) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"id":%d,"pad":"%s"}`, i, padding))
	now := time.Now().UTC().Format(time.RFC3339Nano)
	for k, v := range map[string]string{
		middleware.AttemptKey: "2", middleware.FirstFailureKey: now, middleware.LastFailureKey: now,
		middleware.LastErrorKey: errTransient.Error(), middleware.ErrorClassKey: middleware.ClassTransient,
		middleware.OriginalQueueKey: origin, middleware.DelayKey: strconv.FormatInt(d.Milliseconds(), 10),
		hdrIndex: strconv.Itoa(i),
	} {
		msg.Metadata.Set(k, v)
	}
	return msg
}

// fillVariant is one variant of parts 3 and 4: the topology of an
// originating queue q (nothing consumes it) and how a delayed message is
// scheduled for q.
type fillVariant struct {
	name     string
	q        string
	schedule func(ctx context.Context, msg *message.Message, d time.Duration) error
	holders  []string // queues holding the waiting messages
	close    func()
}

func (b *bench) newFillVariant(res *cascadeResult, variant string) (*fillVariant, error) {
	e := b.env
	v := &fillVariant{name: variant, q: e.name("cas", "fill", variant)}
	q := v.q
	cfg := amqpretry.Config{Subscriber: wamqp.NewDurableQueueConfig(e.uri), Logger: e.logger, Naming: e.naming("cas-fill-" + variant),
		Policy: router.Policy{QueueName: func(context.Context) string { return q }}}
	tiers := strings.HasPrefix(variant, "tiers")
	levelType := amqpretry.QueueTypeQuorum
	if variant == "cascade-classic" {
		levelType = amqpretry.QueueTypeClassic
	}
	cc, _ := e.cascadeConfig(levelType)
	if tiers {
		cfg.Mode = amqpretry.Tiers(cascadeMemTiers...)
		if variant == "tiers-quorum" {
			cfg.QueueType = amqpretry.QueueTypeQuorum
		}
	} else {
		cfg.Mode = cascade.Mode(cc)
	}
	retry, _, closeAll, err := e.retryConsumer(cfg, q) // declares q's topology and, for the cascade, the levels and q's binding
	if err != nil {
		return nil, err
	}
	v.close = closeAll
	if tiers {
		topo := retry.Topology()
		wx := topo.Naming().WaitExchange
		m := retry.SubscriberConfig().Marshaler
		pub := retry.Publisher()
		v.schedule = func(ctx context.Context, msg *message.Message, d time.Duration) error {
			// what amqpretry's Delayer.Schedule does for a delay > 0
			p, err := m.Marshal(msg)
			if err != nil {
				return err
			}
			return pub.PublishRaw(ctx, wx, topo.Naming().WaitQueue(q, topo.TierFor(d)), p)
		}
		v.holders = topo.WaitQueues(q)
		return v, nil
	}
	dcfg := cascadeCore(cc)
	dcfg.Publisher, dcfg.Marshaler, dcfg.QueueName = retry.Publisher(), amqpretry.Marshaler{Topology: retry.Topology()}, func(context.Context) string { return q }
	d, err := cascadecore.NewDelayer(dcfg) // what cascade.Mode builds
	if err != nil {
		closeAll()
		return nil, err
	}
	v.close = func() {
		_ = d.Close()
		closeAll()
	}
	if err := d.Bind(q); err != nil {
		v.close()
		return nil, err
	}
	v.schedule = d.Schedule
	for n := range res.Levels {
		v.holders = append(v.holders, dcfg.LevelName(n))
	}
	return v, nil
}

// fillDelays are the delays of parts 3 and 4: uniform in [1 h, 2 h).
func fillDelays(n int) []time.Duration {
	rng := rand.New(rand.NewPCG(7, 99))
	delays := make([]time.Duration, n)
	for i := range delays {
		delays[i] = cascadeMemMin + time.Duration(rng.Int64N(int64(cascadeMemMin)))
	}
	return delays
}

// scheduleRange schedules messages from..to-1 from workers goroutines and
// returns the wall time.
func (v *fillVariant) scheduleRange(delays []time.Duration, from, to, workers int) (time.Duration, error) {
	var next atomic.Int64
	next.Store(int64(from))
	var firstErr atomic.Pointer[error]
	var wg sync.WaitGroup
	t0 := time.Now()
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= to || firstErr.Load() != nil {
					return
				}
				if err := v.schedule(context.Background(), retryLikeMessage(i, v.q, delays[i]), delays[i]); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					return
				}
			}
		})
	}
	wg.Wait()
	if p := firstErr.Load(); p != nil {
		return 0, *p
	}
	return time.Since(t0), nil
}

// purge empties the variant's holding queues.
func (v *fillVariant) purge(e *env) error {
	ch, err := e.channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	for _, h := range v.holders {
		if _, err := ch.QueuePurge(h, false); err != nil {
			return fmt.Errorf("purging %s: %w", h, err)
		}
	}
	return nil
}

// cascadeFill runs parts 3 and 4: the four variants' topologies side by
// side; cascadeRounds rounds, in each every variant in turn schedules
// 1,000 messages one at a time and then cascade-sched from the workers
// (purged after each round); medians are reported. Then, variant by
// variant, cascade-mem messages are scheduled and left waiting, memory is
// read, and the queues are purged.
func (b *bench) cascadeFill(res *cascadeResult) (err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	nSched := b.size("cascade-sched", 20000)
	nMem := b.size("cascade-mem", 100000)
	nSerial := min(1000, max(nSched/10, 2)) // one goroutine: the latency a handler sees per retry
	workers := b.cascade.workers
	delays := fillDelays(max(nMem, nSerial+nSched))
	var vs []*fillVariant
	defer func() {
		for _, v := range vs {
			v.close()
		}
	}()
	for _, name := range cascadeFillVariants {
		v, err := b.newFillVariant(res, name)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		vs = append(vs, v)
		tiers := strings.HasPrefix(name, "tiers")
		if name == "tiers" || name == "cascade" { // the other queue type passes the same queues
			hopSum, hopMax := 0, 0
			for _, d := range delays {
				h := 1
				if !tiers {
					h = bits.OnesCount64(uint64((d + cascadecore.DefaultGrain - 1) / cascadecore.DefaultGrain))
				}
				hopSum += h
				hopMax = max(hopMax, h)
			}
			nd := len(delays)
			res.Hops = append(res.Hops, cascadeHops{Variant: name, Sample: fmt.Sprintf("%d delays uniform in [1h, 2h)", nd),
				HopsMean: float64(hopSum) / float64(nd), HopsMax: hopMax, PublishesMean: 1 + float64(hopSum)/float64(nd), PublishesMax: 1 + hopMax})
		}
	}
	if slices.Contains(b.cascade.parts, "sched") {
		rates := map[string][]float64{}
		lats := map[string][]time.Duration{}
		serialRates := map[string][]float64{}
		for r := range cascadeRounds {
			for k := range vs {
				v := vs[(k+r)%len(vs)] // rotate the order each round
				t0 := time.Now()
				for i := range nSerial {
					t := time.Now()
					if err := v.schedule(context.Background(), retryLikeMessage(i, v.q, delays[i]), delays[i]); err != nil {
						return fmt.Errorf("%s: %w", v.name, err)
					}
					lats[v.name] = append(lats[v.name], time.Since(t))
				}
				serialRates[v.name] = append(serialRates[v.name], float64(nSerial)/time.Since(t0).Seconds())
				took, err := v.scheduleRange(delays, nSerial, nSerial+nSched, workers)
				if err != nil {
					return fmt.Errorf("%s: %w", v.name, err)
				}
				rates[v.name] = append(rates[v.name], float64(nSched)/took.Seconds())
				logf("cascade %s round %d: %d schedules in %.1f s (%.0f msg/s, %d workers); serial %.0f msg/s",
					v.name, r+1, nSched, took.Seconds(), float64(nSched)/took.Seconds(), workers, serialRates[v.name][r])
				if err := v.purge(e); err != nil {
					return err
				}
			}
		}
		for _, v := range vs {
			l := lats[v.name]
			slices.Sort(l)
			res.Sched = append(res.Sched, cascadeSched{Variant: v.name, Messages: nSched, Workers: workers, Rounds: cascadeRounds,
				RatePerS: median(rates[v.name]), Rates: rates[v.name],
				SerialMessages: nSerial, SerialRatePerS: median(serialRates[v.name]),
				SerialP50Ms: ms2(percentile(l, 50)), SerialP99Ms: ms2(percentile(l, 99))})
		}
	}
	if !slices.Contains(b.cascade.parts, "memory") {
		return nil
	}
	for _, v := range vs {
		if err := b.cascadeMemory(res, v, delays[:nMem]); err != nil {
			return fmt.Errorf("%s: %w", v.name, err)
		}
	}
	return nil
}

// cascadeRounds is the number of throughput rounds (median reported).
const cascadeRounds = 3

// cascadeMemory fills v with len(delays) waiting messages, reads the
// broker's and this process's memory, and purges v's queues.
func (b *bench) cascadeMemory(res *cascadeResult, v *fillVariant, delays []time.Duration) error {
	e := b.env
	nMem := len(delays)
	runtime.GC()
	debug.FreeOSMemory()
	memBefore := sampleMem(3)
	nodeBefore, nodeOK := readNodeMemory()
	took, err := v.scheduleRange(delays, 0, nMem, b.cascade.workers)
	if err != nil {
		return err
	}
	m := cascadeMem{Variant: v.name, FillRatePerS: float64(nMem) / took.Seconds()}
	logf("cascade %s: %d scheduled in %.1f s (%.0f msg/s)", v.name, nMem, took.Seconds(), m.FillRatePerS)
	// Quorum queues report their counts a moment after the confirms: wait
	// until list_queues shows every message (bounded).
	var st map[string]brokerQueue
	for deadline := time.Now().Add(60 * time.Second); ; {
		var ok bool
		st, ok = brokerQueuesStats()
		if !ok {
			logf("cascade memory: %s does not answer list_queues; no broker figures", strings.Join(ctlPrefix(), " "))
			break
		}
		var total int64
		for _, h := range v.holders {
			total += st[h].Messages
		}
		if total >= int64(nMem) || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Second) // polling the broker's counters
	}
	var levels []string
	for _, h := range v.holders {
		q, ok := st[h]
		if !ok {
			continue
		}
		m.Waiting += q.Messages
		m.QueueMiB += mib(q.MemoryBytes)
		if q.Messages > 0 {
			m.Queues++
			if !strings.HasPrefix(v.name, "tiers") {
				levels = append(levels, fmt.Sprintf("%s:%d", h[strings.LastIndex(h, ".")+1:], q.Messages))
			}
		}
	}
	m.Levels = strings.Join(levels, " ")
	if after, ok := readNodeMemory(); ok && nodeOK {
		m.NodeBefore, m.NodeAfter = &nodeBefore, &after
	}
	runtime.GC()
	debug.FreeOSMemory()
	m.ClientBefore, m.ClientAfter = memBefore, sampleMem(3)
	logf("cascade %s memory: %d waiting in %d queues, queue memory %.1f MiB %s", v.name, m.Waiting, m.Queues, m.QueueMiB, m.Levels)
	res.Memory = append(res.Memory, m)
	return v.purge(e)
}

// brokerQueuesStats is brokerQueueStats for every queue at once (one
// rabbitmqctl call).
func brokerQueuesStats() (map[string]brokerQueue, bool) {
	out, err := ctl("-q", "list_queues", "name", "memory", "messages", "--no-table-headers")
	if err != nil {
		return nil, false
	}
	m := map[string]brokerQueue{}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 3 {
			var st brokerQueue
			st.MemoryBytes, _ = strconv.ParseInt(f[1], 10, 64)
			st.Messages, _ = strconv.ParseInt(f[2], 10, 64)
			m[f[0]] = st
		}
	}
	return m, true
}

// fmtErrMs prints an error in ms, or in s from 10 s on.
func fmtErrMs(ms float64) string {
	if ms >= 10000 || ms <= -10000 {
		return fmt.Sprintf("%+.1f s", ms/1000)
	}
	return fmt.Sprintf("%+.0f ms", ms)
}

func (b *bench) cascadeRows(res *cascadeResult) {
	sc := "7 tiers vs cascade"
	type key struct {
		v  string
		ms int64
	}
	acc := map[key]cascadeDelayStats{}
	for _, a := range res.Accuracy {
		acc[key{a.Variant, a.AskedMs}] = a
	}
	for _, ms := range res.Bands {
		t, c, s := acc[key{"tiers", ms}], acc[key{"cascade", ms}], acc[key{"scheduled", ms}]
		if t.Messages == 0 && c.Messages == 0 {
			continue
		}
		f := func(x cascadeDelayStats) string {
			return fmt.Sprintf("%s / %s / %s", fmtErrMs(x.P50Ms), fmtErrMs(x.P99Ms), fmtErrMs(x.MaxMs))
		}
		b.row(sc, fmt.Sprintf("asked %s (%d msgs each): observed - asked, p50 / p99 / max", fmtDur(time.Duration(ms)*time.Millisecond), t.Messages),
			fmt.Sprintf("tiers (waits %s): %s; cascade retry: %s; cascade.Publisher: %s", fmtDur(time.Duration(t.WaitMs)*time.Millisecond), f(t), f(c), f(s)),
			"cascade p99 <= 100 ms + 1%", passMiss(c.P99Ms <= 100+0.01*float64(ms) && s.P99Ms <= 100+0.01*float64(ms) && c.MinMs >= 0 && s.MinMs >= 0))
	}
	for _, h := range res.Hops {
		v := fmt.Sprintf("queues passed mean %.2f / max %d; publishes (client + dead-letter) mean %.2f / max %d", h.HopsMean, h.HopsMax, h.PublishesMean, h.PublishesMax)
		if h.XDeathMessages > 0 {
			v += fmt.Sprintf("; measured x-death entries mean %.2f / max %d (%d msgs)", h.XDeathMean, h.XDeathMax, h.XDeathMessages)
		}
		b.row(sc, fmt.Sprintf("hops per delayed message, %s, %s", h.Variant, h.Sample), v, "", "")
	}
	for _, s := range res.Sched {
		v := fmt.Sprintf("%s (median of %d rounds of %d, %d goroutines: %s)", fmtRate(s.RatePerS), s.Rounds, s.Messages, s.Workers, fmtRatesUnit(s.Rates))
		what := s.Variant + ": to the tier's wait queue (amqpretry Delayer's publish)"
		if !strings.HasPrefix(s.Variant, "tiers") {
			what = s.Variant + ": the cascade Delayer's Schedule"
		}
		b.row(sc, fmt.Sprintf("scheduling throughput, confirmed, %s", what), v, "", "")
		b.row(sc, fmt.Sprintf("one schedule at a time (%d, 1 goroutine), %s: latency p50 / p99; rate", s.SerialMessages, s.Variant),
			fmt.Sprintf("%.2f / %.2f ms; %s", s.SerialP50Ms, s.SerialP99Ms, fmtRate(s.SerialRatePerS)), "", "")
	}
	if p := res.Probe; p != nil {
		b.row(sc, fmt.Sprintf("routing probe, raw amqp091, %d confirmed publishes of cascade keys (1-2 h), 256 in flight: to the top exchange (level %d, FirstExchange) vs to the highest set bit's level exchange (EntryExchange, what the Delayer uses)", p.Messages, res.Levels-1),
			fmt.Sprintf("%s vs %s (medians; rounds %s vs %s)", fmtRate(p.FirstMedian), fmtRate(p.TopBitMedian), fmtRatesUnit(p.FirstRates), fmtRatesUnit(p.TopBitRates)), "", "")
	}
	for _, m := range res.Memory {
		where := fmt.Sprintf("%s: %d %s wait queues (tiers %s)", m.Variant, len(cascadeMemTiers), cascadeVariantType[m.Variant], fmtDurs(cascadeMemTiers))
		if !strings.HasPrefix(m.Variant, "tiers") {
			where = fmt.Sprintf("%s: %s levels (%s)", m.Variant, cascadeVariantType[m.Variant], m.Levels)
		}
		b.row(sc, fmt.Sprintf("broker memory, %d waiting in %s (filled at %s)", m.Waiting, where, fmtRate(m.FillRatePerS)), fmtBrokerMem(m.QueueMiB, m.NodeBefore, m.NodeAfter), "", "")
		if m.NodeBefore != nil && m.NodeAfter != nil {
			b.row(sc, fmt.Sprintf("broker node breakdown delta, %s: quorum_queue_procs / quorum_ets / queue_procs / binary", m.Variant),
				fmt.Sprintf("%+.1f / %+.1f / %+.1f / %+.1f MiB", mib(m.NodeAfter.QuorumProcs-m.NodeBefore.QuorumProcs), mib(m.NodeAfter.QuorumETS-m.NodeBefore.QuorumETS),
					mib(m.NodeAfter.QueueProcs-m.NodeBefore.QueueProcs), mib(m.NodeAfter.Binary-m.NodeBefore.Binary)), "", "")
		}
		b.row(sc, fmt.Sprintf("client RSS / heap after GC, %s: empty -> %d waiting", m.Variant, m.Waiting),
			fmt.Sprintf("%.1f -> %.1f MiB / %.1f -> %.1f MiB", m.ClientBefore.RSSMiB, m.ClientAfter.RSSMiB, m.ClientBefore.HeapMiB, m.ClientAfter.HeapMiB), "", "")
	}
}

// cascadeNotes is appended to the Markdown report when the cascade
// scenario ran.
const cascadeNotes = `
## Tiers vs the delay cascade: how the figures are measured

One broker, one process. **Tiers**: amqpretry's default retry topology, a
classic wait queue per tier per originating queue (x-message-ttl = the tier,
dead-lettered back through the loop-back exchange); a handler's
` + "`RetryAfter(d)`" + ` waits in the smallest tier >= d. Accuracy tiers: 1s/2s/4s/8s/16s/32s/1m/2m/5m/10m
(the default backoff's doubling tiers extended to 32 s, then round values to
10 min; amqpretry's default tiers for MaxAttempts 5 are 1/2/4/8 s and would
clamp every RetryAfter above 8 s to 8 s). **Cascade**:
` + "`amqpretry.Config{Mode: cascade.Mode(cascade.Config{})}`" + `, the
defaults (26 quorum level queues, 100 ms grain, at-least-once
dead-lettering), under the run's prefix.

1. **Accuracy**: per band (asked delay) N messages, one random interleaving,
   published 10 every 50 ms to each variant's queue at the same time; the
   three variants run concurrently. Retry variants (4 handlers, prefetch
   256): attempt 1 fails with ` + "`middleware.RetryAfter(err, asked)`" + ` (backoff a
   constant 1 ms, so the asked delay is the delay), attempt 2 succeeds;
   observed = start of attempt 2 - the moment attempt 1 returned (includes
   the confirmed publish, the wait, dead-lettering and delivery).
   **cascade.Publisher**: ` + "`delay.Message(msg, delay.For(asked))`" + ` then
   ` + "`Publish(queue, msg)`" + ` (confirmed), a raw amqp091 consumer (auto-ack) on a
   plain durable queue; observed = arrival - the moment of marking.
   Error = observed - asked: for tiers it is mostly the rounding up to the
   tier ("waits"), for the cascade the rounding up to the 100 ms grain plus
   the broker's TTL expiry and per-hop dead-lettering.
2. **Hops / publishes**: computed from the routing arithmetic (cascade:
   popcount of ceil(delay / 100 ms) level queues passed, each a broker
   dead-letter publish into a quorum queue; tiers: 1 wait queue) and, for
   the accuracy messages, measured as the number of x-death entries the
   delivered message carries (one per queue it expired from). Publishes =
   1 client publish + one dead-letter publish per hop.
3. **Scheduling latency and throughput**: first 1,000 schedules one at a
   time from one goroutine (the latency of each: what a handler waits per
   retry), then 20,000 from 64 goroutines sharing the Retry's
   confirm.Publisher (mandatory, publisher confirms; each call returns once
   confirmed); a retry-like watermill message (attempt 2, failure metadata)
   with a delay uniform in [1 h, 2 h). Tiers: marshal + publish to the wait
   exchange with the tier's wait queue as key (what amqpretry's Delayer does
   for a delay > 0), tiers 1h/2h. Cascade: ` + "`the cascade Delayer's Schedule`" + `
   (what DelayerFactory installs). Each with its default queue type (tiers:
   classic wait queues; cascade: quorum levels) and with the other one
   (tiers-quorum: ` + "`QueueType: quorum`" + `; cascade-classic: ` + "`cascade.Config{QueueType: classic}`" + `,
   at-most-once between levels). The four topologies exist side by side;
   3 rounds, each variant in turn (order rotated each round), queues purged
   after each turn; the median rate (messages / wall time) is reported.
   **Routing probe** (no library): raw amqp091 confirmed publishes (256 in
   flight, mandatory) of the cascade keys of the same 1-2 h delays, to the
   cascade's top exchange (level 25, FirstExchange: the message passes
   each leading-zero level's topic exchange through exchange-to-exchange
   bindings before its first level queue) vs straight to the exchange of
   the level of the delay's highest set bit (EntryExchange, which the
   Delayer and Publisher use; same routing key, same queues); 3 rounds alternating, level queues purged after each.
4. **Memory**: variant by variant, 100,000 scheduled (64 goroutines) and
   left waiting, then purged (nothing
   expires during the measurement: the shortest wait is 1 h, in the cascade
   a message first waits in level 15 (54.6 min) or 16). Broker: ` + "`rabbitmqctl list_queues name memory messages`" + `
   summed over the variant's queues (for a quorum queue its Ra server
   process), and the node's ` + "`rabbitmqctl status`" + ` memory (erlang, rss, and the
   breakdown's quorum_queue_procs / quorum_ets / queue_procs / binary)
   before and after the fill, both through ` + "`$RABBITRETRY_CTL`" + `. Client: this
   process's VmRSS and Go heap in use after runtime.GC + FreeOSMemory,
   before and after (what the client keeps while messages wait). The
   variant's queues are deleted before the next variant starts; node
   figures include what the allocators keep from before and are indicative.
`

// cascadeGlance is the "at a glance" part of the Markdown report: the
// accuracy per band, and the cost figures per variant, as two tables.
func cascadeGlance(res *cascadeResult) string {
	if res == nil {
		return ""
	}
	var sb strings.Builder
	sb.WriteString("\n## Tiers vs the delay cascade at a glance\n\n")
	if len(res.Accuracy) > 0 {
		fmt.Fprintf(&sb, "Observed - asked delay, p50 / p99 / max, %d messages per band and variant, the three variants at the same time (%.0f s):\n\n", res.PerBand, res.AccuracyS)
		sb.WriteString("| asked | tiers: waits | tiers (classic wait queues) | cascade retry (quorum levels) | hops | cascade.Publisher (scheduled) |\n|---|---|---|---|---|---|\n")
		acc := map[string]cascadeDelayStats{}
		for _, a := range res.Accuracy {
			acc[a.Variant+strconv.FormatInt(a.AskedMs, 10)] = a
		}
		f := func(x cascadeDelayStats) string {
			return fmt.Sprintf("%s / %s / %s", fmtErrMs(x.P50Ms), fmtErrMs(x.P99Ms), fmtErrMs(x.MaxMs))
		}
		for _, ms := range res.Bands {
			k := strconv.FormatInt(ms, 10)
			t, c, s := acc["tiers"+k], acc["cascade"+k], acc["scheduled"+k]
			fmt.Fprintf(&sb, "| %s | %s | %s | %s | %d | %s |\n", fmtDur(time.Duration(ms)*time.Millisecond), fmtDur(time.Duration(t.WaitMs)*time.Millisecond), f(t), f(c), c.HopsComputed, f(s))
		}
		sb.WriteString("\n")
	}
	if len(res.Sched) == 0 {
		return sb.String()
	}
	cols := []string{}
	for _, s := range res.Sched {
		cols = append(cols, s.Variant)
	}
	sb.WriteString("| per variant | " + strings.Join(cols, " | ") + " |\n|---|" + strings.Repeat("---|", len(cols)) + "\n")
	line := func(name string, cell func(v string) string) {
		cells := make([]string, len(cols))
		for i, v := range cols {
			cells[i] = cell(v)
		}
		sb.WriteString("| " + name + " | " + strings.Join(cells, " | ") + " |\n")
	}
	line("queue type", func(v string) string { return cascadeVariantType[v] })
	sched := map[string]cascadeSched{}
	for _, s := range res.Sched {
		sched[s.Variant] = s
	}
	line(fmt.Sprintf("confirmed schedules/s, %d goroutines", sched[cols[0]].Workers), func(v string) string { return fmtRate(sched[v].RatePerS) })
	line("one at a time: latency p50 / p99", func(v string) string {
		return fmt.Sprintf("%.2f / %.2f ms", sched[v].SerialP50Ms, sched[v].SerialP99Ms)
	})
	hops := map[string]cascadeHops{}
	for _, h := range res.Hops {
		if strings.Contains(h.Sample, "[1h, 2h)") {
			hops[h.Variant] = h
		}
	}
	base := func(v string) string { return strings.TrimSuffix(strings.TrimSuffix(v, "-quorum"), "-classic") }
	line("queues passed (1-2 h delays): mean / max", func(v string) string {
		h := hops[base(v)]
		return fmt.Sprintf("%.2f / %d", h.HopsMean, h.HopsMax)
	})
	line("publishes per message (client + dead-letter): mean", func(v string) string { return fmt.Sprintf("%.2f", hops[base(v)].PublishesMean) })
	mem := map[string]cascadeMem{}
	for _, m := range res.Memory {
		mem[m.Variant] = m
	}
	if len(mem) > 0 {
		n := res.Memory[0].Waiting
		line(fmt.Sprintf("broker: queue memory, %d waiting", n), func(v string) string { return fmt.Sprintf("%.1f MiB", mem[v].QueueMiB) })
		line("fill rate (64 goroutines)", func(v string) string { return fmtRate(mem[v].FillRatePerS) })
		line("broker: node memory delta, erlang / rss", func(v string) string {
			m := mem[v]
			if m.NodeBefore == nil || m.NodeAfter == nil {
				return "n/a"
			}
			return fmt.Sprintf("%+.1f / %+.1f MiB", mib(m.NodeAfter.Erlang-m.NodeBefore.Erlang), mib(m.NodeAfter.RSS-m.NodeBefore.RSS))
		})
		line("client: RSS delta after GC", func(v string) string {
			m := mem[v]
			return fmt.Sprintf("%+.1f MiB", m.ClientAfter.RSSMiB-m.ClientBefore.RSSMiB)
		})
	}
	if p := res.Probe; p != nil {
		fmt.Fprintf(&sb, "\nRouting probe (raw amqp091, %d confirmed publishes of cascade keys for 1-2 h, 256 in flight, quorum levels): to the top exchange (level %d, FirstExchange; what the Delayer and Publisher did before they used EntryExchange) %s; to the exchange of the delay's highest set bit (EntryExchange, same key, same queues) %s.\n",
			p.Messages, res.Levels-1, fmtRate(p.FirstMedian), fmtRate(p.TopBitMedian))
	}
	return sb.String()
}

// cascadeProbe is the routing probe of part 3 (raw amqp091, no library):
// confirmed publishes of cascade keys for 1-2 h delays, 256 in flight, to
// the cascade's top exchange (level Levels-1, FirstExchange: the message
// passes every leading-zero level's topic exchange by exchange-to-exchange
// bindings; what the Delayer and Publisher did before they used
// EntryExchange) vs straight to the exchange of the level of the highest
// set bit (EntryExchange: the same queues, the same routing key). Rates are medians of cascadeRounds rounds, alternating.
type cascadeProbe struct {
	Messages     int       `json:"messages"`
	FirstRates   []float64 `json:"first_exchange_rates_per_s"`
	TopBitRates  []float64 `json:"highest_bit_exchange_rates_per_s"`
	FirstMedian  float64   `json:"first_exchange_rate_per_s"`
	TopBitMedian float64   `json:"highest_bit_exchange_rate_per_s"`
}

func (b *bench) cascadeRoutingProbe(res *cascadeResult, n int) (err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	pc, levels := e.cascadeConfig(amqpretry.QueueTypeQuorum)
	cc := cascadeCore(pc)
	ch, err := e.channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	if err := cc.Declare(ch); err != nil {
		return err
	}
	q := e.name("cas", "probe")
	e.trackQueues(q)
	if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
		return err
	}
	if err := cc.BindDestination(ch, q); err != nil {
		return err
	}
	delays := fillDelays(n)
	keys := make([]string, n)
	for i, d := range delays {
		if keys[i], err = cc.RoutingKey(d, q); err != nil {
			return err
		}
	}
	grain := func(d time.Duration) uint64 {
		return uint64((d + cascadecore.DefaultGrain - 1) / cascadecore.DefaultGrain)
	}
	first := func(int) string { return cc.FirstExchange() }
	topBit := func(i int) string { return cc.EntryExchange(grain(delays[i])) }
	purge := func() error {
		for l := range levels {
			if _, err := ch.QueuePurge(cc.LevelName(l), false); err != nil {
				return err
			}
		}
		return nil
	}
	e.mu.Lock()
	conn := e.admin
	e.mu.Unlock()
	p := &cascadeProbe{Messages: n}
	for r := range cascadeRounds {
		for k := range 2 {
			exch, rates := first, &p.FirstRates
			if (k+r)%2 == 1 {
				exch, rates = topBit, &p.TopBitRates
			}
			took, err := fillKeys(conn, n, exch, func(i int) string { return keys[i] })
			if err != nil {
				return err
			}
			*rates = append(*rates, float64(n)/took.Seconds())
			if err := purge(); err != nil {
				return err
			}
		}
	}
	p.FirstMedian, p.TopBitMedian = median(p.FirstRates), median(p.TopBitRates)
	logf("cascade routing probe: via the first exchange %s, via the highest set bit's level %s", fmtRatesUnit(p.FirstRates), fmtRatesUnit(p.TopBitRates))
	res.Probe = p
	return nil
}

// fillKeys publishes n persistent 128-byte messages, message i to exchange
// exch(i) with key key(i), mandatory, 256 awaiting their confirm at once.
func fillKeys(conn *amqp.Connection, n int, exch func(int) string, key func(int) string) (time.Duration, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	defer func() { _ = ch.Close() }()
	if err := ch.Confirm(false); err != nil {
		return 0, err
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 512))
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	body := []byte(`{"pad":"` + padding + `"}`)
	out := 0
	await := func() error {
		c, ok := <-confirms
		if !ok {
			return errors.New("channel closed while waiting for confirms")
		}
		if !c.Ack {
			return fmt.Errorf("publish %d nacked", c.DeliveryTag)
		}
		out--
		return nil
	}
	t0 := time.Now()
	for i := range n {
		if out >= 256 {
			if err := await(); err != nil {
				return 0, err
			}
		}
		if err := ch.PublishWithContext(context.Background(), exch(i), key(i), true, false,
			amqp.Publishing{DeliveryMode: amqp.Persistent, Body: body}); err != nil {
			return 0, err
		}
		out++
	}
	for out > 0 {
		if err := await(); err != nil {
			return 0, err
		}
	}
	took := time.Since(t0)
	select {
	case r := <-returns:
		return 0, fmt.Errorf("a probe message was returned unroutable: %s %s", r.Exchange, r.RoutingKey)
	default:
	}
	return took, nil
}
