package main

import (
	"fmt"
	"slices"
)

type tracingResult struct {
	Messages     int       `json:"messages"`
	Prefetch     int       `json:"prefetch"`
	RetryRuns    []float64 `json:"retry_msg_per_s_runs"`
	TracedRuns   []float64 `json:"traced_msg_per_s_runs"`
	RetryCPU     []float64 `json:"retry_client_cpu_us_per_msg_runs"`
	TracedCPU    []float64 `json:"traced_client_cpu_us_per_msg_runs"`
	RetryMedian  float64   `json:"retry_msg_per_s_median"`
	TracedMedian float64   `json:"traced_msg_per_s_median"`
	Ratio        float64   `json:"ratio"`
	BestRatio    float64   `json:"best_of_runs_ratio"`
}

// scenarioTracing: the retry chain with and without middleware.Tracing
// (amqpretry.Config.Tracing, the global TracerProvider, which is the no-op
// one: what an application pays before it installs an SDK), no failures,
// prefetch 256; runs alternate and the order flips every round.
func (b *bench) scenarioTracing() error {
	n := b.size("tracing", 20000)
	const pf = 256
	res := &tracingResult{Messages: n, Prefetch: pf}
	b.summary.Tracing = res
	for r := range b.runs {
		order := []bool{false, true}
		if r%2 == 1 {
			order = []bool{true, false}
		}
		for _, traced := range order {
			d, err := b.env.drain(drainSpec{scenario: "trc", retry: true, tracing: traced, prefetch: pf, handlers: 1, n: n})
			if err != nil {
				return err
			}
			logf("tracing run %d traced=%v: %.0f msg/s (client CPU %.1f us/msg)", r+1, traced, d.Rate, d.CPUUsPerMsg)
			if traced {
				res.TracedRuns, res.TracedCPU = append(res.TracedRuns, d.Rate), append(res.TracedCPU, d.CPUUsPerMsg)
			} else {
				res.RetryRuns, res.RetryCPU = append(res.RetryRuns, d.Rate), append(res.RetryCPU, d.CPUUsPerMsg)
			}
		}
	}
	res.RetryMedian, res.TracedMedian = median(res.RetryRuns), median(res.TracedRuns)
	res.Ratio = res.TracedMedian / res.RetryMedian
	res.BestRatio = slices.Max(res.TracedRuns) / slices.Max(res.RetryRuns)
	b.row("7 tracing", fmt.Sprintf("retry chain, prefetch %d (median of %d; runs %s)", pf, b.runs, fmtRates(res.RetryRuns)), fmtRate(res.RetryMedian), "", "")
	b.row("7 tracing", fmt.Sprintf("retry chain + Tracing, no-op provider (median of %d; runs %s)", b.runs, fmtRates(res.TracedRuns)), fmtRate(res.TracedMedian), "", "")
	b.row("7 tracing", "ratio traced/untraced throughput", fmt.Sprintf("%.3f", res.Ratio), ">= 0.97", passMiss(res.Ratio >= 0.97))
	b.row("7 tracing", "best-of-runs ratio (info)", fmt.Sprintf("%.3f", res.BestRatio), "", "")
	b.row("7 tracing", "client CPU per msg untraced / traced (info)",
		fmt.Sprintf("%.1f / %.1f us", median(res.RetryCPU), median(res.TracedCPU)), "", "")
	return nil
}
