package main

import "fmt"

type concurrencyRun struct {
	Handlers int     `json:"handlers"`
	Rate     float64 `json:"msg_per_s"`
	DrainS   float64 `json:"drain_s"`
}

type concurrencyResult struct {
	Messages int              `json:"messages"`
	Prefetch int              `json:"prefetch_per_handler"`
	Runs     []concurrencyRun `json:"runs"`
}

// scenarioConcurrency: the retry chain with 1, 2, 4, 8 handlers on the same
// topic (each handler is its own watermill-amqp subscription: own channel,
// own consumer on the same queue, prefetch 256 each), no failures, one run
// per handler count.
func (b *bench) scenarioConcurrency() error {
	n := b.size("concurrency", 20000)
	res := &concurrencyResult{Messages: n, Prefetch: 256}
	b.summary.Concurrency = res
	sc := "6 concurrency"
	b.row(sc, "setup", fmt.Sprintf("%d msgs, no failures, retry chain, prefetch 256 per handler, 1 run each", n), "", "")
	var one float64
	for _, h := range []int{1, 2, 4, 8} {
		d, err := b.env.drain(drainSpec{scenario: "conc", retry: true, prefetch: 256, handlers: h, n: n})
		if err != nil {
			return err
		}
		logf("concurrency %d handler(s): %.0f msg/s", h, d.Rate)
		res.Runs = append(res.Runs, concurrencyRun{Handlers: h, Rate: d.Rate, DrainS: d.DrainS})
		if h == 1 {
			one = d.Rate
		}
		b.row(sc, fmt.Sprintf("%d handler(s)", h), fmt.Sprintf("%s (x%.2f)", fmtRate(d.Rate), d.Rate/one), "", "")
	}
	return nil
}
