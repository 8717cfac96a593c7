package main

import (
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

type delayTier struct {
	TierMs   int64   `json:"tier_ms"`
	Messages int     `json:"messages"`
	P50Ms    float64 `json:"error_p50_ms"`
	P99Ms    float64 `json:"error_p99_ms"`
	MaxMs    float64 `json:"error_max_ms"`
	MinMs    float64 `json:"error_min_ms"`
	GoalMs   float64 `json:"goal_p99_ms"`
	Pass     bool    `json:"pass"`
}

type delayResult struct {
	Tiers []delayTier `json:"tiers"`
	// HOL: 200ms-tier messages whose observed delay exceeded 300 ms, with
	// the 3s-tier messages published (and failed) before them.
	HOLOver300ms int     `json:"hol_200ms_over_300ms"`
	HOLMaxMs     float64 `json:"hol_200ms_max_observed_ms"`
	// Native: the native delayed retry (RabbitMQ 4.3+), TierMs its Min;
	// absent (NativeUnavailable set) on older brokers.
	Native            *delayTier `json:"native,omitempty"`
	NativeUnavailable string     `json:"native_unavailable,omitempty"`
}

func (b *bench) scenarioDelay() error {
	if err := b.delayTiers(); err != nil {
		return err
	}
	return b.delayNative()
}

// delayTiers: tiers 200ms, 1s, 3s. Each message fails its first attempt
// with RetryAfter(tier) (the backoff is a constant 1 ms, so the delay is the
// tier exactly) and succeeds on its second. Observed delay = handler start
// of attempt 2 minus the moment attempt 1 returned its error (so it includes
// the confirm of the retry publish, the TTL, dead-lettering, the loop-back
// and the delivery). The queue is pre-filled in the order 3s, 1s, 200ms so
// that the 200ms retries are scheduled after the 3s ones: with one wait
// queue per tier they must not wait behind them (head-of-line check).
func (b *bench) delayTiers() (err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	per := b.size("delay", 200)
	tiers := []time.Duration{3 * time.Second, time.Second, 200 * time.Millisecond} // publish order
	n := per * len(tiers)
	q := e.name("delay", watermillShort())
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = 256
	retry, sub, closeAll, err := e.retryConsumer(amqpretry.Config{
		Subscriber: cfg, Naming: e.naming("delay"), Logger: e.logger,
		Mode:   amqpretry.Tiers(200*time.Millisecond, time.Second, 3*time.Second),
		Policy: router.Policy{Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(time.Millisecond) }},
	}, q)
	if err != nil {
		return err
	}
	defer closeAll()
	mk := func(i int) amqp.Publishing {
		return benchPublishing(i, amqp.Table{hdrTierMs: strconv.FormatInt(tiers[i/per].Milliseconds(), 10)})
	}
	// The long tiers are queued up front (they must be waiting when the short
	// ones arrive, for the head-of-line check). The 200 ms messages are
	// published paced, after the long ones had their first attempt: a
	// returning retry joins the tail of the queue, so a burst of first
	// attempts still in the queue would add queueing time to the measured
	// delay, which is not what this scenario measures.
	long := 2 * per
	if _, err := e.fillQueue(q, long, mk); err != nil {
		return err
	}
	var firstAttempts atomic.Int64
	var mu sync.Mutex
	failedAt := make(map[string]time.Time, n)
	observed := map[int64][]time.Duration{}
	tr := newTracker(n)
	handler := func(msg *message.Message) error {
		now := time.Now()
		tierMs, _ := strconv.ParseInt(msg.Metadata.Get(hdrTierMs), 10, 64)
		if middleware.Attempt(msg) == 1 {
			firstAttempts.Add(1)
			mu.Lock()
			failedAt[msg.UUID] = time.Now()
			mu.Unlock()
			return middleware.RetryAfter(errTransient, time.Duration(tierMs)*time.Millisecond)
		}
		mu.Lock()
		if t0, ok := failedAt[msg.UUID]; ok {
			observed[tierMs] = append(observed[tierMs], now.Sub(t0))
			delete(failedAt, msg.UUID)
			mu.Unlock()
			tr.hit()
			return nil
		}
		mu.Unlock()
		return nil
	}
	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: 1,
		middlewares: []message.HandlerMiddleware{retry.Middleware}, handler: handler})
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(30 * time.Second); firstAttempts.Load() < int64(long); {
		if time.Now().After(deadline) {
			_ = rr.close()
			return fmt.Errorf("delay accuracy: first attempts of the long tiers did not finish")
		}
		time.Sleep(5 * time.Millisecond) // polling the counter
	}
	if err := e.fillPaced(q, long, n-long, mk); err != nil {
		_ = rr.close()
		return err
	}
	werr := tr.wait(60*time.Second, "delay accuracy")
	if cerr := rr.close(); cerr != nil && werr == nil {
		werr = cerr
	}
	if werr != nil {
		return werr
	}
	res := &delayResult{}
	b.summary.Delay = res
	sc := "4 delay accuracy"
	b.row(sc, "setup", fmt.Sprintf("tiers 200ms/1s/3s, %d msgs each: 3s and 1s queued first, 200ms published paced (10 per 50 ms) while those wait; error = observed - tier", per), "", "")
	for _, tier := range []time.Duration{200 * time.Millisecond, time.Second, 3 * time.Second} {
		obs := observed[tier.Milliseconds()]
		errs := make([]time.Duration, len(obs))
		for i, o := range obs {
			errs[i] = o - tier
		}
		slices.Sort(errs)
		goal := 50 + 0.01*ms(tier)
		dt := delayTier{TierMs: tier.Milliseconds(), Messages: len(errs), P50Ms: ms(percentile(errs, 50)),
			P99Ms: ms(percentile(errs, 99)), MaxMs: ms(percentile(errs, 100)), MinMs: ms(percentile(errs, 0)), GoalMs: goal}
		dt.Pass = dt.P99Ms <= goal
		res.Tiers = append(res.Tiers, dt)
		b.row(sc, fmt.Sprintf("tier %v: error p50 / p99 / max (min)", tier),
			fmt.Sprintf("%.1f / %.1f / %.1f ms (%.1f)", dt.P50Ms, dt.P99Ms, dt.MaxMs, dt.MinMs),
			fmt.Sprintf("p99 <= %.0f ms", goal), passMiss(dt.Pass))
		if tier == 200*time.Millisecond {
			for _, o := range obs {
				if o > 300*time.Millisecond {
					res.HOLOver300ms++
				}
			}
			res.HOLMaxMs = ms(percentile(sortedCopy(obs), 100))
		}
	}
	b.row(sc, "head-of-line: 200ms msgs (after 3s ones) observed > 300 ms", fmt.Sprintf("%d of %d (max %.0f ms)", res.HOLOver300ms, per, res.HOLMaxMs),
		"0", passMiss(res.HOLOver300ms == 0))
	return nil
}

func sortedCopy(xs []time.Duration) []time.Duration {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s
}
