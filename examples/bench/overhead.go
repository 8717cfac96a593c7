package main

import (
	"fmt"
	"slices"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// drainSpec is one "pre-fill a queue, then drain it with a router" run.
type drainSpec struct {
	scenario string // short name used in queue names
	retry    bool   // with amqpretry (SubscriberConfig + Middleware) or bare watermill-amqp
	tracing  bool   // with retry: amqpretry.Config.Tracing on (the global, no-op, TracerProvider)
	prefetch int
	handlers int
	n        int
}

type drainResult struct {
	Rate     float64 `json:"msg_per_s"`
	DrainS   float64 `json:"drain_s"`
	FillRate float64 `json:"fill_msg_per_s"`
	// CPUUsPerMsg is the bench process's user+system CPU time from router
	// start to the last message, per message: the client-side cost, much
	// less sensitive than wall-clock rates to other load on the machine.
	CPUUsPerMsg float64 `json:"client_cpu_us_per_msg"`
	Handlers    int     `json:"handlers"`
	Prefetch    int     `json:"prefetch"`
	Messages    int     `json:"messages"`
	WithRetry   bool    `json:"with_retry"`
}

// drain pre-fills a fresh queue with s.n messages (pipelined confirms), then
// starts the router and measures the time from the first to the last handled
// message of a no-op handler. Queues and exchanges are deleted afterwards.
func (e *env) drain(s drainSpec) (res drainResult, err error) {
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	variant := "bare"
	if s.retry {
		variant = "retry"
	}
	if s.tracing {
		variant = "traced"
	}
	q := e.name(s.scenario, variant, fmt.Sprintf("p%d", s.prefetch), fmt.Sprintf("h%d", s.handlers), watermillShort())
	e.trackQueues(q)
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = s.prefetch
	var mws []message.HandlerMiddleware
	if s.retry {
		rc := amqpretry.Config{Subscriber: cfg, Naming: e.naming(s.scenario), Logger: e.logger}
		if s.tracing {
			rc.Tracing = &middleware.TracingConfig{}
		}
		retry, err := amqpretry.New(rc)
		if err != nil {
			return res, err
		}
		defer func() { _ = retry.Close() }()
		e.trackRetry(retry, q)
		cfg = retry.SubscriberConfig()
		mws = append(mws, retry.Middleware)
	}
	sub, err := wamqp.NewSubscriber(cfg, e.logger)
	if err != nil {
		return res, err
	}
	defer func() { _ = sub.Close() }()
	if err := sub.SubscribeInitialize(q); err != nil {
		return res, err
	}
	fillTook, err := e.fillQueue(q, s.n, func(i int) amqp.Publishing { return benchPublishing(i, nil) })
	if err != nil {
		return res, fmt.Errorf("filling %s: %w", q, err)
	}
	tr := newTracker(s.n)
	cpu0 := cpuTime()
	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: s.handlers, middlewares: mws,
		handler: func(*message.Message) error { tr.hit(); return nil }})
	if err != nil {
		return res, err
	}
	werr := tr.wait(time.Duration(s.n/100+60)*time.Second, "drain "+q)
	cpu := cpuTime() - cpu0
	if cerr := rr.close(); cerr != nil && werr == nil {
		werr = cerr
	}
	if werr != nil {
		return res, werr
	}
	return drainResult{Rate: tr.rate(), DrainS: tr.span().Seconds(), FillRate: float64(s.n) / fillTook.Seconds(),
		CPUUsPerMsg: float64(cpu.Microseconds()) / float64(s.n),
		Handlers:    s.handlers, Prefetch: s.prefetch, Messages: s.n, WithRetry: s.retry}, nil
}

type overheadPrefetch struct {
	Prefetch    int       `json:"prefetch"`
	BareRuns    []float64 `json:"bare_msg_per_s_runs"`
	RetryRuns   []float64 `json:"retry_msg_per_s_runs"`
	BareCPU     []float64 `json:"bare_client_cpu_us_per_msg_runs"`
	RetryCPU    []float64 `json:"retry_client_cpu_us_per_msg_runs"`
	BareMedian  float64   `json:"bare_msg_per_s_median"`
	RetryMedian float64   `json:"retry_msg_per_s_median"`
	Ratio       float64   `json:"ratio"`
	// CPU medians (µs per message) and the retry/bare CPU ratio.
	// BestRatio = best retry run / best bare run: interference from other
	// load only slows runs down, so the best runs are the least disturbed.
	BestRatio      float64 `json:"best_of_runs_ratio"`
	BareCPUMedian  float64 `json:"bare_client_cpu_us_per_msg_median"`
	RetryCPUMedian float64 `json:"retry_client_cpu_us_per_msg_median"`
}

type overheadResult struct {
	Messages int                `json:"messages"`
	Runs     map[string]int     `json:"runs_per_variant_by_prefetch"`
	Results  []overheadPrefetch `json:"by_prefetch"`
}

// scenarioOverhead: bare watermill-amqp router vs the same router with the
// retry middleware, no failures, at prefetch 256 and at watermill-amqp's
// default prefetch (1); runs alternate bare/retry, and the order flips every
// round so neither variant always goes first.
func (b *bench) scenarioOverhead() error {
	n := b.size("overhead", 20000)
	res := &overheadResult{Messages: n, Runs: map[string]int{"256": b.runs, "1": b.runsP1}}
	b.summary.Overhead = res
	for _, pf := range []int{256, 1} {
		runs := b.runs
		if pf == 1 {
			runs = b.runsP1
		}
		op := overheadPrefetch{Prefetch: pf}
		for r := range runs {
			order := []bool{false, true}
			if r%2 == 1 {
				order = []bool{true, false}
			}
			for _, withRetry := range order {
				d, err := b.env.drain(drainSpec{scenario: "ovh", retry: withRetry, prefetch: pf, handlers: 1, n: n})
				if err != nil {
					return err
				}
				logf("overhead prefetch=%d run %d retry=%v: %.0f msg/s (%d msgs in %.2fs; client CPU %.1f us/msg; fill %.0f msg/s)",
					pf, r+1, withRetry, d.Rate, n, d.DrainS, d.CPUUsPerMsg, d.FillRate)
				if withRetry {
					op.RetryRuns = append(op.RetryRuns, d.Rate)
					op.RetryCPU = append(op.RetryCPU, d.CPUUsPerMsg)
				} else {
					op.BareRuns = append(op.BareRuns, d.Rate)
					op.BareCPU = append(op.BareCPU, d.CPUUsPerMsg)
				}
			}
		}
		op.BareMedian, op.RetryMedian = median(op.BareRuns), median(op.RetryRuns)
		op.Ratio = op.RetryMedian / op.BareMedian
		op.BareCPUMedian, op.RetryCPUMedian = median(op.BareCPU), median(op.RetryCPU)
		op.BestRatio = slices.Max(op.RetryRuns) / slices.Max(op.BareRuns)
		res.Results = append(res.Results, op)
		b.row("1 overhead", fmt.Sprintf("bare watermill-amqp, prefetch %d (median of %d; runs %s)", pf, runs, fmtRates(op.BareRuns)), fmtRate(op.BareMedian), "", "")
		b.row("1 overhead", fmt.Sprintf("with retry.Middleware, prefetch %d (median of %d; runs %s)", pf, runs, fmtRates(op.RetryRuns)), fmtRate(op.RetryMedian), "", "")
		b.row("1 overhead", fmt.Sprintf("ratio retry/bare, prefetch %d", pf), fmt.Sprintf("%.3f", op.Ratio), ">= 0.95", passMiss(op.Ratio >= 0.95))
		b.row("1 overhead", fmt.Sprintf("best-of-runs ratio retry/bare, prefetch %d (info)", pf), fmt.Sprintf("%.3f", op.BestRatio), "", "")
		b.row("1 overhead", fmt.Sprintf("client CPU per msg bare / retry, prefetch %d (info)", pf),
			fmt.Sprintf("%.1f / %.1f us (%+.1f us, x%.2f)", op.BareCPUMedian, op.RetryCPUMedian,
				op.RetryCPUMedian-op.BareCPUMedian, op.RetryCPUMedian/op.BareCPUMedian), "", "")
	}
	return nil
}

func watermillShort() string { return fmt.Sprintf("%d", time.Now().UnixNano()%1_000_000) }

func fmtRates(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.0f", x)
	}
	return strings.Join(parts, ", ")
}
