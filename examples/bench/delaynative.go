package main

import (
	"fmt"
	"slices"
	"sync"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// delayNativeHold is Min = Max of the native delayed retry measured here.
const delayNativeHold = time.Second

// delayNative: the delay of a native delayed retry (RabbitMQ 4.3+ quorum
// queue, NativeDelayedRetry{Min: Max: 1s}). Each message fails its first
// attempt (backoff a constant 1 s, so the computed delay is within Max and
// the retry is native) and succeeds on its second. Observed delay = handler
// start of attempt 2 minus the moment attempt 1 returned its error (so it
// includes the nack, the broker's hold and the redelivery); intended = Min
// (the hold of a message whose x-delivery-count is 0: no consumer crashed
// holding it). The messages are published paced, 10 every 50 ms, while the
// consumer runs, like the 200ms tier of delayTiers: a message that comes
// back joins the queue, so a burst of first attempts still queued would add
// queueing time, which is not what this measures.
func (b *bench) delayNative() (err error) {
	e := b.env
	res := b.summary.Delay
	sc := "4 delay accuracy"
	name := fmt.Sprintf("native delayed retry (quorum, Min = Max = %v)", delayNativeHold)
	goal := 50 + 0.01*ms(delayNativeHold)
	if !e.nativeSupported() {
		res.NativeUnavailable = nativeNA
		b.row(sc, name+": error p50 / p99 / max (min)", nativeNA, fmt.Sprintf("p99 <= %.0f ms", goal), "n/a")
		return nil
	}
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	n := b.size("delay", 200)
	q := e.name("delay", "native", watermillShort())
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = 256
	retry, sub, closeAll, err := e.retryConsumer(amqpretry.Config{
		Subscriber: cfg, Naming: e.naming("delaynative"), Logger: e.logger,
		QueueType: amqpretry.QueueTypeQuorum,
		Mode: amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: delayNativeHold, Max: delayNativeHold,
			Tiers: []time.Duration{delayNativeHold}}),
		Policy: router.Policy{Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(delayNativeHold) }},
	}, q)
	if err != nil {
		return err
	}
	defer closeAll()
	var mu sync.Mutex
	failedAt := make(map[string]time.Time, n)
	var observed []time.Duration
	tr := newTracker(n)
	handler := func(msg *message.Message) error {
		now := time.Now()
		if middleware.Attempt(msg) == 1 {
			mu.Lock()
			failedAt[msg.UUID] = time.Now()
			mu.Unlock()
			return errTransient
		}
		mu.Lock()
		t0, ok := failedAt[msg.UUID]
		if ok {
			observed = append(observed, now.Sub(t0))
			delete(failedAt, msg.UUID)
		}
		mu.Unlock()
		if ok {
			tr.hit()
		}
		return nil
	}
	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: 1,
		middlewares: []message.HandlerMiddleware{retry.Middleware}, handler: handler})
	if err != nil {
		return err
	}
	if err := e.fillPaced(q, 0, n, func(i int) amqp.Publishing { return benchPublishing(i, nil) }); err != nil {
		_ = rr.close()
		return err
	}
	werr := tr.wait(60*time.Second, "delay accuracy (native)")
	if cerr := rr.close(); cerr != nil && werr == nil {
		werr = cerr
	}
	if werr != nil {
		return werr
	}
	errs := make([]time.Duration, len(observed))
	for i, o := range observed {
		errs[i] = o - delayNativeHold
	}
	slices.Sort(errs)
	dt := delayTier{TierMs: delayNativeHold.Milliseconds(), Messages: len(errs), P50Ms: ms(percentile(errs, 50)),
		P99Ms: ms(percentile(errs, 99)), MaxMs: ms(percentile(errs, 100)), MinMs: ms(percentile(errs, 0)), GoalMs: goal}
	dt.Pass = dt.P99Ms <= goal
	res.Native = &dt
	logf("delay accuracy native %v: error p50 %.1f ms p99 %.1f ms max %.1f ms min %.1f ms", delayNativeHold, dt.P50Ms, dt.P99Ms, dt.MaxMs, dt.MinMs)
	b.row(sc, fmt.Sprintf("%s, %d msgs published paced (10 per 50 ms): error p50 / p99 / max (min)", name, n),
		fmt.Sprintf("%.1f / %.1f / %.1f ms (%.1f)", dt.P50Ms, dt.P99Ms, dt.MaxMs, dt.MinMs),
		fmt.Sprintf("p99 <= %.0f ms", goal), passMiss(dt.Pass))
	return nil
}
