package main

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

var errTransient = errors.New("downstream busy (transient)")

type stormRun struct {
	Variant  string `json:"variant"` // "rabbitretry", "rabbitretry-dl", "rabbitretry-native" or "watermill-retry"
	Failures bool   `json:"failures"`
	Messages int    `json:"messages"`
	Failing  int    `json:"failing"`
	Handlers int    `json:"handlers"`
	Prefetch int    `json:"prefetch"`
	// DrainS: first handler call to the last message's first attempt
	// (every message of the backlog handled once). DrainRate = messages/DrainS.
	DrainS    float64 `json:"drain_s"`
	DrainRate float64 `json:"drain_msg_per_s"`
	// CompleteS: first handler call to the last success (retries included).
	CompleteS float64 `json:"complete_s"`
	// Healthy latency: handler time of the (only, successful) attempt of a
	// never-failing message minus its publish timestamp.
	HealthyP50Ms float64 `json:"healthy_latency_p50_ms"`
	HealthyP99Ms float64 `json:"healthy_latency_p99_ms"`
	HealthyMaxMs float64 `json:"healthy_latency_max_ms"`
	FillS        float64 `json:"fill_s"`
}

type stormResult struct {
	Runs []stormRun `json:"runs"`
	// LibDrainRatio = rabbitretry drain rate with failures / without (the
	// medians over the runs of each).
	LibDrainRatio float64 `json:"rabbitretry_drain_ratio"`
	WMDrainRatio  float64 `json:"watermill_drain_ratio"`
	// P99Ratio = Watermill Retry healthy p99 / rabbitretry healthy p99.
	P99Ratio float64 `json:"healthy_p99_ratio_watermill_over_rabbitretry"`
	// DLDrainRatio is the drain ratio of quorum queues with DeadLetterFirstRetry.
	DLDrainRatio float64 `json:"rabbitretry_dead_letter_first_drain_ratio"`
	// NativeDrainRatio is the drain ratio of quorum queues with
	// NativeDelayedRetry; absent (NativeUnavailable set) below RabbitMQ 4.3.
	NativeDrainRatio  *float64 `json:"rabbitretry_native_drain_ratio,omitempty"`
	NativeUnavailable string   `json:"native_unavailable,omitempty"`
}

// stormNative is the native delayed retry of the "rabbitretry-native" storm
// variant: every first retry waits Min = 1 s in the queue, like the other
// variants' 1 s first tier. Max is 2 s, not 1 s: the default backoff's first
// delay is 1 s ±50% jitter (up to 1.5 s), and a computed delay above Max
// would take the wait-queue path instead; Max only caps the broker's hold
// of a message whose consumer crashed (x-delivery-count), so every retry of
// the storm waits Min.
var stormNative = amqpretry.NativeDelayedRetry{Min: time.Second, Max: 2 * time.Second}

// stormOnce fills a fresh queue with n messages, every 10th of which (when
// failures is set) fails transiently on its first attempt, and drains it
// with either this library (retries wait in the broker, 1 s first tier) or
// Watermill's in-process Retry{MaxRetries: 3, InitialInterval: 1s} +
// PoisonQueue. Same subscriber config (prefetch, handlers) for all. The
// library runs in three modes: "rabbitretry" (classic queues, every retry a
// confirmed publish to a wait queue), "rabbitretry-dl" (quorum queues,
// DeadLetterFirstRetry: a first-tier retry is a nack the broker
// dead-letters into the 1 s wait queue) and "rabbitretry-native" (quorum
// queues, NativeDelayedRetry, RabbitMQ 4.3+: a retry is a nack with requeue
// and the queue itself holds the message for 1 s).
func (b *bench) stormOnce(variant string, failures bool, n, handlers int) (run stormRun, err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	const prefetch = 256
	q := e.name("storm", variant, strconv.FormatBool(failures), watermillShort())
	e.trackQueues(q)
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = prefetch
	var mws []message.HandlerMiddleware
	switch variant {
	case "rabbitretry":
		// Library defaults: MaxAttempts 5, DefaultBackoff (1 s, x2, ±50%
		// jitter) -> tiers 1s, 2s, 4s, 8s.
		retry, err := amqpretry.New(amqpretry.Config{Subscriber: cfg, Naming: e.naming("storm"), Logger: e.logger})
		if err != nil {
			return run, err
		}
		defer func() { _ = retry.Close() }()
		e.trackRetry(retry, q)
		cfg = retry.SubscriberConfig()
		mws = append(mws, retry.Middleware)
	case "rabbitretry-dl":
		// Quorum queues with DeadLetterFirstRetry: first-tier retries are
		// nacks that the broker dead-letters into the first wait queue.
		retry, err := amqpretry.New(amqpretry.Config{Subscriber: cfg, Naming: e.naming("storm"), Logger: e.logger,
			QueueType: amqpretry.QueueTypeQuorum, Mode: amqpretry.DeadLetterFirst()})
		if err != nil {
			return run, err
		}
		defer func() { _ = retry.Close() }()
		e.trackRetry(retry, q)
		cfg = retry.SubscriberConfig()
		mws = append(mws, retry.Middleware)
	case "rabbitretry-native":
		retry, err := amqpretry.New(amqpretry.Config{Subscriber: cfg, Naming: e.naming("storm"), Logger: e.logger,
			QueueType: amqpretry.QueueTypeQuorum, Mode: amqpretry.NativeDelayed(stormNative)})
		if err != nil {
			return run, err
		}
		defer func() { _ = retry.Close() }()
		e.trackRetry(retry, q)
		cfg = retry.SubscriberConfig()
		mws = append(mws, retry.Middleware)
	case "watermill-retry":
		pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(e.uri), e.logger)
		if err != nil {
			return run, err
		}
		defer func() { _ = pub.Close() }()
		poisonTopic := q + ".poison"
		e.trackQueues(poisonTopic)
		poison, err := wmw.PoisonQueue(pub, poisonTopic)
		if err != nil {
			return run, err
		}
		mws = append(mws, poison, wmw.Retry{MaxRetries: 3, InitialInterval: time.Second}.Middleware)
	default:
		return run, fmt.Errorf("unknown storm variant %q", variant)
	}
	sub, err := wamqp.NewSubscriber(cfg, e.logger)
	if err != nil {
		return run, err
	}
	defer func() { _ = sub.Close() }()
	if err := sub.SubscribeInitialize(q); err != nil {
		return run, err
	}
	fillTook, err := e.fillQueue(q, n, func(i int) amqp.Publishing { return benchPublishing(i, nil) })
	if err != nil {
		return run, err
	}

	failing := 0
	if failures {
		failing = (n + 9) / 10
	}
	base := time.Now()
	firstPass, done := newTrackerAt(base, n), newTrackerAt(base, n)
	var mu sync.Mutex
	calls := make(map[string]int, n)
	healthy := make([]time.Duration, 0, n)
	handler := func(msg *message.Message) error {
		now := time.Now()
		i, _ := strconv.Atoi(msg.Metadata.Get(hdrIndex))
		mu.Lock()
		calls[msg.UUID]++
		c := calls[msg.UUID]
		mu.Unlock()
		if c == 1 {
			firstPass.hit()
		}
		willFail := failures && i%10 == 0
		if willFail && c == 1 {
			return errTransient
		}
		if !willFail {
			if pub, ok := publishedAt(msg); ok {
				mu.Lock()
				healthy = append(healthy, now.Sub(pub))
				mu.Unlock()
			}
		}
		if c == 1 || willFail {
			done.hit()
		}
		return nil
	}
	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: handlers, middlewares: mws, handler: handler})
	if err != nil {
		return run, err
	}
	// Watermill's Retry sleeps 1 s in the handler per failing message.
	timeout := 120*time.Second + time.Duration(failing)*1200*time.Millisecond/time.Duration(max(handlers, 1))
	werr := done.wait(timeout, "storm "+variant)
	if cerr := rr.close(); cerr != nil && werr == nil {
		werr = cerr
	}
	if werr != nil {
		return run, werr
	}
	slices.Sort(healthy)
	run = stormRun{Variant: variant, Failures: failures, Messages: n, Failing: failing, Handlers: handlers, Prefetch: prefetch,
		DrainS:       time.Duration(firstPass.last.Load() - firstPass.first.Load()).Seconds(),
		CompleteS:    time.Duration(done.last.Load() - firstPass.first.Load()).Seconds(),
		HealthyP50Ms: ms(percentile(healthy, 50)), HealthyP99Ms: ms(percentile(healthy, 99)),
		HealthyMaxMs: ms(percentile(healthy, 100)), FillS: fillTook.Seconds()}
	run.DrainRate = float64(n) / run.DrainS
	return run, nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// stormVariantNames are the storm variants, in run order (-storm-variants).
var stormVariantNames = []string{"rabbitretry", "rabbitretry-dl", "rabbitretry-native", "watermill-retry"}

func (b *bench) scenarioStorm() error {
	n := b.size("storm", 2000)
	res := &stormResult{}
	b.summary.Storm = res
	runs := map[string][]stormRun{} // variant + failures -> runs
	native := b.env.nativeSupported()
	if !native {
		res.NativeUnavailable = nativeNA
		logf("storm: rabbitretry-native skipped: %s, the broker is %s", nativeNA, b.summary.Machine.ServerVersion)
	}
	var variants []string
	for _, v := range b.stormVariants {
		if v != "rabbitretry-native" || native {
			variants = append(variants, v)
		}
	}
	// Rounds: every library variant with and without failures once per
	// round, in an order that flips every round, so that other load on the
	// machine (the drains take 0.05-0.3 s) spreads over all of them.
	// Watermill Retry runs in the first round only.
	for r := range b.stormRuns {
		for _, variant := range variants {
			if variant == "watermill-retry" && r > 0 {
				continue
			}
			order := []bool{false, true}
			if r%2 == 1 {
				order = []bool{true, false}
			}
			for _, failures := range order {
				if variant == "watermill-retry" && failures {
					logf("storm: Watermill Retry with failures takes about %d s (1 s in-handler sleep per failing message, %d handler(s))",
						(n+9)/10/max(b.stormHandlers, 1), b.stormHandlers)
				}
				run, err := b.stormOnce(variant, failures, n, b.stormHandlers)
				if err != nil {
					return err
				}
				logf("storm round %d %s failures=%v: drain %.3fs (%.0f msg/s), complete %.2fs, healthy p50 %.0f ms p99 %.0f ms",
					r+1, run.Variant, run.Failures, run.DrainS, run.DrainRate, run.CompleteS, run.HealthyP50Ms, run.HealthyP99Ms)
				res.Runs = append(res.Runs, run)
				k := variant + strconv.FormatBool(failures)
				runs[k] = append(runs[k], run)
			}
		}
	}
	has := func(v string) bool { return slices.Contains(b.stormVariants, v) }
	sc := "2 failure storm"
	b.row(sc, "setup", fmt.Sprintf("%d msgs, %d fail once, %d handler(s), prefetch 256; rabbitretry variants: median of %d runs each (Watermill: 1 run)",
		n, (n+9)/10, b.stormHandlers, b.stormRuns), "", "")
	// libRows are the rows of one library mode: drain with failures and
	// without (same queue type), their ratio (goal), healthy latency; each
	// figure the median over the runs.
	libRows := func(variant, name, latencyName string) float64 {
		f, z := medianRun(runs[variant+"true"]), medianRun(runs[variant+"false"])
		ratio := f.DrainRate / z.DrainRate
		b.row(sc, name+": backlog drain (first attempts) / complete", fmt.Sprintf("%.3f s (%s) / %.2f s", f.DrainS, fmtRate(f.DrainRate), f.CompleteS), "", "")
		b.row(sc, name+": no-failure drain", fmt.Sprintf("%.3f s (%s)", z.DrainS, fmtRate(z.DrainRate)), "", "")
		b.row(sc, fmt.Sprintf("%s: drain rate with failures / without (runs %s / %s)", name, fmtRates(drainRates(runs[variant+"true"])), fmtRates(drainRates(runs[variant+"false"]))),
			fmt.Sprintf("%.2f", ratio), ">= 0.8", passMiss(ratio >= 0.8))
		b.row(sc, "healthy latency p50 / p99: "+latencyName, fmt.Sprintf("%.0f / %.0f ms", f.HealthyP50Ms, f.HealthyP99Ms), "", "")
		return ratio
	}
	if has("rabbitretry") {
		res.LibDrainRatio = libRows("rabbitretry", "rabbitretry (classic, publish path)", "rabbitretry (classic, publish path)")
	}
	if has("rabbitretry-dl") {
		res.DLDrainRatio = libRows("rabbitretry-dl", "rabbitretry, quorum + DeadLetterFirstRetry", "quorum + DeadLetterFirstRetry")
	}
	if has("rabbitretry-native") {
		nm := fmt.Sprintf("rabbitretry, quorum + NativeDelayedRetry (Min %v, Max %v)", stormNative.Min, stormNative.Max)
		if native {
			ratio := libRows("rabbitretry-native", nm, "quorum + NativeDelayedRetry")
			res.NativeDrainRatio = &ratio
		} else {
			b.row(sc, nm+": backlog drain (first attempts) / complete", nativeNA, "", "")
			b.row(sc, nm+": no-failure drain", nativeNA, "", "")
			b.row(sc, nm+": drain rate with failures / without", nativeNA, ">= 0.8", "n/a")
			b.row(sc, "healthy latency p50 / p99: quorum + NativeDelayedRetry", nativeNA, "", "")
		}
	}
	if has("watermill-retry") {
		wf, w0 := runs["watermill-retrytrue"][0], runs["watermill-retryfalse"][0]
		res.WMDrainRatio = wf.DrainRate / w0.DrainRate
		b.row(sc, "Watermill Retry: backlog drain / complete", fmt.Sprintf("%.2f s (%s) / %.2f s", wf.DrainS, fmtRate(wf.DrainRate), wf.CompleteS), "", "")
		b.row(sc, "Watermill Retry: no-failure drain", fmt.Sprintf("%.3f s (%s)", w0.DrainS, fmtRate(w0.DrainRate)), "", "")
		b.row(sc, "Watermill Retry: drain rate with failures / without", fmt.Sprintf("%.3f", res.WMDrainRatio), "", "")
		b.row(sc, "healthy latency p50 / p99: Watermill Retry", fmt.Sprintf("%.0f / %.0f ms", wf.HealthyP50Ms, wf.HealthyP99Ms), "", "")
		if has("rabbitretry") {
			lf, l0 := medianRun(runs["rabbitretrytrue"]), medianRun(runs["rabbitretryfalse"])
			res.P99Ratio = wf.HealthyP99Ms / lf.HealthyP99Ms
			b.row(sc, "healthy p99 Watermill / rabbitretry (classic)", fmt.Sprintf("%.1fx", res.P99Ratio), ">= 100x", passMiss(res.P99Ratio >= 100))
			b.row(sc, "healthy latency p50 / p99 without failures: rabbitretry (classic) / Watermill", fmt.Sprintf("%.0f / %.0f ms ; %.0f / %.0f ms",
				l0.HealthyP50Ms, l0.HealthyP99Ms, w0.HealthyP50Ms, w0.HealthyP99Ms), "", "")
		}
	}
	return nil
}

// medianRun is a run whose every figure is the median of that figure over
// runs (DrainRate the median rate, not n / median DrainS).
func medianRun(runs []stormRun) stormRun {
	if len(runs) == 0 {
		return stormRun{}
	}
	pick := func(f func(stormRun) float64) float64 {
		xs := make([]float64, len(runs))
		for i, r := range runs {
			xs[i] = f(r)
		}
		return median(xs)
	}
	m := runs[0]
	m.DrainS = pick(func(r stormRun) float64 { return r.DrainS })
	m.DrainRate = pick(func(r stormRun) float64 { return r.DrainRate })
	m.CompleteS = pick(func(r stormRun) float64 { return r.CompleteS })
	m.HealthyP50Ms = pick(func(r stormRun) float64 { return r.HealthyP50Ms })
	m.HealthyP99Ms = pick(func(r stormRun) float64 { return r.HealthyP99Ms })
	m.HealthyMaxMs = pick(func(r stormRun) float64 { return r.HealthyMaxMs })
	m.FillS = pick(func(r stormRun) float64 { return r.FillS })
	return m
}

func drainRates(runs []stormRun) []float64 {
	xs := make([]float64, len(runs))
	for i, r := range runs {
		xs[i] = r.DrainRate
	}
	return xs
}

func newTrackerAt(base time.Time, target int) *tracker {
	t := newTracker(target)
	t.base = base
	return t
}
