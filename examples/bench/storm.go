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
	Variant  string `json:"variant"` // "rabbitretry" or "watermill-retry"
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
	// LibDrainRatio = rabbitretry drain rate with failures / without.
	LibDrainRatio float64 `json:"rabbitretry_drain_ratio"`
	WMDrainRatio  float64 `json:"watermill_drain_ratio"`
	// P99Ratio = Watermill Retry healthy p99 / rabbitretry healthy p99.
	P99Ratio float64 `json:"healthy_p99_ratio_watermill_over_rabbitretry"`
	// DLDrainRatio is the drain ratio of quorum queues with DeadLetterFirstRetry.
	DLDrainRatio float64 `json:"rabbitretry_dead_letter_first_drain_ratio"`
}

// stormOnce fills a fresh queue with n messages, every 10th of which (when
// failures is set) fails transiently on its first attempt, and drains it
// with either this library (retries wait in the broker, 1 s first tier) or
// Watermill's in-process Retry{MaxRetries: 3, InitialInterval: 1s} +
// PoisonQueue. Same subscriber config (prefetch, handlers) for both.
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
			QueueType: amqpretry.QueueTypeQuorum, DeadLetterFirstRetry: true})
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

func (b *bench) scenarioStorm() error {
	n := b.size("storm", 2000)
	res := &stormResult{}
	b.summary.Storm = res
	get := map[string]stormRun{}
	for _, c := range []struct {
		variant  string
		failures bool
	}{{"rabbitretry", false}, {"rabbitretry", true}, {"rabbitretry-dl", false}, {"rabbitretry-dl", true},
		{"watermill-retry", false}, {"watermill-retry", true}} {
		if c.variant == "watermill-retry" && c.failures {
			logf("storm: Watermill Retry with failures takes about %d s (1 s in-handler sleep per failing message, %d handler(s))",
				(n+9)/10/max(b.stormHandlers, 1), b.stormHandlers)
		}
		r, err := b.stormOnce(c.variant, c.failures, n, b.stormHandlers)
		if err != nil {
			return err
		}
		logf("storm %s failures=%v: drain %.2fs (%.0f msg/s), complete %.2fs, healthy p50 %.0f ms p99 %.0f ms",
			r.Variant, r.Failures, r.DrainS, r.DrainRate, r.CompleteS, r.HealthyP50Ms, r.HealthyP99Ms)
		res.Runs = append(res.Runs, r)
		get[c.variant+strconv.FormatBool(c.failures)] = r
	}
	lf, l0 := get["rabbitretrytrue"], get["rabbitretryfalse"]
	wf, w0 := get["watermill-retrytrue"], get["watermill-retryfalse"]
	res.LibDrainRatio = lf.DrainRate / l0.DrainRate
	res.WMDrainRatio = wf.DrainRate / w0.DrainRate
	res.P99Ratio = wf.HealthyP99Ms / lf.HealthyP99Ms
	sc := "2 failure storm"
	desc := fmt.Sprintf("%d msgs, %d fail once, %d handler(s), prefetch 256", n, lf.Failing, b.stormHandlers)
	b.row(sc, "setup", desc, "", "")
	b.row(sc, "rabbitretry: backlog drain (first attempts) / complete", fmt.Sprintf("%.2f s (%s) / %.2f s", lf.DrainS, fmtRate(lf.DrainRate), lf.CompleteS), "", "")
	b.row(sc, "rabbitretry: no-failure drain", fmt.Sprintf("%.2f s (%s)", l0.DrainS, fmtRate(l0.DrainRate)), "", "")
	b.row(sc, "rabbitretry: drain rate with failures / without", fmt.Sprintf("%.2f", res.LibDrainRatio), ">= 0.8", passMiss(res.LibDrainRatio >= 0.8))
	df, d0 := get["rabbitretry-dltrue"], get["rabbitretry-dlfalse"]
	res.DLDrainRatio = df.DrainRate / d0.DrainRate
	b.row(sc, "rabbitretry, quorum + DeadLetterFirstRetry: backlog drain / complete", fmt.Sprintf("%.2f s (%s) / %.2f s", df.DrainS, fmtRate(df.DrainRate), df.CompleteS), "", "")
	b.row(sc, "rabbitretry, quorum + DeadLetterFirstRetry: no-failure drain", fmt.Sprintf("%.2f s (%s)", d0.DrainS, fmtRate(d0.DrainRate)), "", "")
	b.row(sc, "rabbitretry, quorum + DeadLetterFirstRetry: drain rate with failures / without", fmt.Sprintf("%.2f", res.DLDrainRatio), ">= 0.8", passMiss(res.DLDrainRatio >= 0.8))
	b.row(sc, "healthy latency p50 / p99: quorum + DeadLetterFirstRetry", fmt.Sprintf("%.0f / %.0f ms", df.HealthyP50Ms, df.HealthyP99Ms), "", "")
	b.row(sc, "Watermill Retry: backlog drain / complete", fmt.Sprintf("%.2f s (%s) / %.2f s", wf.DrainS, fmtRate(wf.DrainRate), wf.CompleteS), "", "")
	b.row(sc, "Watermill Retry: no-failure drain", fmt.Sprintf("%.2f s (%s)", w0.DrainS, fmtRate(w0.DrainRate)), "", "")
	b.row(sc, "Watermill Retry: drain rate with failures / without", fmt.Sprintf("%.3f", res.WMDrainRatio), "", "")
	b.row(sc, "healthy latency p50 / p99: rabbitretry", fmt.Sprintf("%.0f / %.0f ms", lf.HealthyP50Ms, lf.HealthyP99Ms), "", "")
	b.row(sc, "healthy latency p50 / p99: Watermill Retry", fmt.Sprintf("%.0f / %.0f ms", wf.HealthyP50Ms, wf.HealthyP99Ms), "", "")
	b.row(sc, "healthy p99 Watermill / rabbitretry", fmt.Sprintf("%.1fx", res.P99Ratio), ">= 100x", passMiss(res.P99Ratio >= 100))
	b.row(sc, "healthy latency p50 / p99 without failures: rabbitretry / Watermill", fmt.Sprintf("%.0f / %.0f ms ; %.0f / %.0f ms",
		l0.HealthyP50Ms, l0.HealthyP99Ms, w0.HealthyP50Ms, w0.HealthyP99Ms), "", "")
	return nil
}

func newTrackerAt(base time.Time, target int) *tracker {
	t := newTracker(target)
	t.base = base
	return t
}
