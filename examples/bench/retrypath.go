package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
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

// retryTier is the single wait tier of the retry-path scenario: long enough
// that no copy comes back while the scenario measures (copies are deleted
// with the queues afterwards).
const retryTier = time.Minute

type retryPathRun struct {
	// Mode: "rabbitretry" (classic, publish path), "rabbitretry-dl" (quorum,
	// DeadLetterFirstRetry), "rabbitretry-native" (quorum,
	// NativeDelayedRetry), "raw-serial", "raw-pipelined" (classic queues) or
	// "raw-pipelined-quorum".
	Mode     string  `json:"mode"`
	Handlers int     `json:"handlers"`
	Messages int     `json:"messages"`
	Rate     float64 `json:"retries_per_s"`
	SpanS    float64 `json:"span_s"`
	// SettledS (rabbitretry-dl): first RetryScheduled to the moment the wait
	// queue held every dead-lettered message (the broker dead-letters
	// asynchronously, after the nack); SettledRate = messages / SettledS.
	SettledS    float64 `json:"broker_settled_s,omitempty"`
	SettledRate float64 `json:"broker_settled_per_s,omitempty"`
}

type retryPathResult struct {
	Runs []retryPathRun `json:"runs"`
	// Ratios of the library to the comparable raw ceiling (raw-serial with
	// the same number of consumers), by handler count.
	Ratios map[string]float64 `json:"ratio_vs_raw_serial_by_handlers"`
	// RatioVsPipelined is the publish-path library (its best handler count)
	// over the pipelined raw ceiling on classic queues (one consumer, up to
	// prefetch confirms in flight).
	RatioVsPipelined float64 `json:"ratio_best_vs_raw_pipelined"`
	// ModeRatios: each library mode's best rate (over the handler counts)
	// over the higher of the two raw pipelined ceilings (CeilingQueueType:
	// classic or quorum queues); absent for a mode the broker lacks.
	ModeRatios       map[string]float64 `json:"ratio_best_vs_raw_pipelined_by_mode"`
	CeilingQueueType string             `json:"raw_pipelined_ceiling_queue_type"`
	// ModeRatiosQuorum: the same over the raw pipelined ceiling on quorum
	// queues (info: the queue type of the dl and native modes).
	ModeRatiosQuorum  map[string]float64 `json:"ratio_best_vs_raw_pipelined_quorum_by_mode,omitempty"`
	NativeUnavailable string             `json:"native_unavailable,omitempty"`
}

// retryModes are the library's retry paths measured here, with how each
// is configured for a 1-minute retry that does not come back during the
// measurement.
var retryModes = []struct {
	mode, short, name string
}{
	{"rabbitretry", "publish path", "publish path (classic; copy -> 1m wait queue, confirm, ack)"},
	{"rabbitretry-dl", "DeadLetterFirstRetry", "quorum + DeadLetterFirstRetry (nack; the broker dead-letters into the 1m wait queue)"},
	{"rabbitretry-native", "NativeDelayedRetry", "quorum + NativeDelayedRetry, Min = Max = 1m (nack with requeue; the queue holds it)"},
}

// counting observer: RetryScheduled calls, first to last.
type retryObserver struct {
	middleware.NopObserver
	t *tracker
}

func (o retryObserver) RetryScheduled(*message.Message, int, time.Duration, time.Duration) { o.t.hit() }
func (o retryObserver) RetryFailed(_ *message.Message, _ int, err error) {
	logf("retry path: RetryFailed: %v", err)
}

// retryLib: every message fails its first attempt and the library
// schedules the retry in one of its modes: "rabbitretry" publishes the copy
// to the 1-minute wait queue with a confirm, then acks; "rabbitretry-dl"
// (quorum, DeadLetterFirstRetry, the 1-minute wait queue its first tier)
// nacks and the broker dead-letters the message into the wait queue;
// "rabbitretry-native" (quorum, NativeDelayedRetry with Min = Max = 1
// minute) nacks with requeue and the queue holds the message in its delayed
// state. Either way nothing comes back during the measurement. Measured: the
// rate of Observer.RetryScheduled from the first to the last (for the nack
// modes it is called just before the nack is sent).
func (b *bench) retryLib(mode string, n, handlers int) (run retryPathRun, err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	q := e.name("retry", mode, fmt.Sprintf("h%d", handlers), watermillShort())
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = 256
	tr := newTracker(n)
	rc := amqpretry.Config{
		Subscriber: cfg, Naming: e.naming("retry"), Logger: e.logger,
		Mode:   amqpretry.Tiers(retryTier),
		Policy: router.Policy{Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(retryTier) }, Observer: retryObserver{t: tr}},
	}
	switch mode {
	case "rabbitretry":
	case "rabbitretry-dl":
		rc.QueueType, rc.Mode = amqpretry.QueueTypeQuorum, amqpretry.DeadLetterFirst(retryTier)
	case "rabbitretry-native":
		rc.QueueType, rc.Mode = amqpretry.QueueTypeQuorum, amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: retryTier, Max: retryTier, Tiers: []time.Duration{retryTier}})
	default:
		return run, fmt.Errorf("unknown retry path mode %q", mode)
	}
	retry, err := amqpretry.New(rc)
	if err != nil {
		return run, err
	}
	defer func() { _ = retry.Close() }()
	e.trackRetry(retry, q)
	sub, err := wamqp.NewSubscriber(retry.SubscriberConfig(), e.logger)
	if err != nil {
		return run, err
	}
	defer func() { _ = sub.Close() }()
	if err := sub.SubscribeInitialize(q); err != nil {
		return run, err
	}
	if _, err := e.fillQueue(q, n, func(i int) amqp.Publishing { return benchPublishing(i, nil) }); err != nil {
		return run, err
	}
	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: handlers, middlewares: []message.HandlerMiddleware{retry.Middleware},
		handler: func(msg *message.Message) error {
			if middleware.Attempt(msg) == 1 {
				return errTransient
			}
			return nil
		}})
	if err != nil {
		return run, err
	}
	werr := tr.wait(time.Duration(n/50+60)*time.Second, "retry path ("+mode+")")
	run = retryPathRun{Mode: mode, Handlers: handlers, Messages: n, Rate: tr.rate(), SpanS: tr.span().Seconds()}
	if werr == nil && mode == "rabbitretry-dl" {
		// The broker dead-letters after the nack, asynchronously: how long
		// until the wait queue holds them all (info).
		werr = pollQueueLen(e, retry.Topology().WaitQueues(q)[0], n, 60*time.Second)
		run.SettledS = (time.Since(tr.base) - time.Duration(tr.first.Load())).Seconds()
		run.SettledRate = float64(n) / run.SettledS
	}
	if cerr := rr.close(); cerr != nil && werr == nil {
		werr = cerr
	}
	if werr != nil {
		return run, werr
	}
	if mode == "rabbitretry" {
		if got, err := e.queueLen(retry.Topology().WaitQueues(q)[0]); err == nil && got != n {
			logf("retry path %s: the wait queue holds %d messages, expected %d", mode, got, n)
		}
	}
	// rabbitretry-native: the nacked messages stay in q in the delayed state,
	// which a passive declare does not count (it counts ready messages).
	return run, nil
}

// pollQueueLen returns once queue q holds at least n ready messages.
func pollQueueLen(e *env, q string, n int, timeout time.Duration) error {
	for deadline := time.Now().Add(timeout); ; {
		got, err := e.queueLen(q)
		if err != nil {
			return err
		}
		if got >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s holds only %d of %d messages after %v", q, got, n, timeout)
		}
		time.Sleep(5 * time.Millisecond) // polling the queue length
	}
}

// retryRaw is the ceiling with amqp091-go alone: consume from a source queue
// (prefetch 256), publish each delivery's body and headers to a durable
// queue with a 1-minute TTL (mandatory, persistent, publisher confirms), and
// ack the delivery once its confirm came.
//
//   - pipelined=false: consumers goroutines, each with its own consume
//     channel and its own confirm channel, one message at a time: publish,
//     wait for the confirm, ack, next. This is what a watermill-amqp
//     subscription does (one message in the handler at a time).
//   - pipelined=true: one consumer; it publishes every delivery at once and a
//     second goroutine acks each delivery when its confirm arrives, so up to
//     prefetch (256) confirms are in flight.
//
// quorum declares both queues as quorum queues (the queue type of the
// DeadLetterFirstRetry and native modes), else classic.
func (b *bench) retryRaw(n, consumers int, pipelined, quorum bool) (run retryPathRun, err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	mode := "raw-serial"
	if pipelined {
		mode, consumers = "raw-pipelined", 1
	}
	srcArgs, dstArgs := amqp.Table{}, amqp.Table{"x-message-ttl": retryTier.Milliseconds()}
	if quorum {
		mode += "-quorum"
		srcArgs["x-queue-type"], dstArgs["x-queue-type"] = amqpretry.QueueTypeQuorum, amqpretry.QueueTypeQuorum
	}
	src := e.name("retry", mode, fmt.Sprintf("h%d", consumers), watermillShort())
	dst := src + ".wait"
	e.trackQueues(src, dst)
	conn, err := amqp.Dial(e.uri)
	if err != nil {
		return run, err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return run, err
	}
	if _, err := ch.QueueDeclare(src, true, false, false, false, srcArgs); err != nil {
		return run, err
	}
	if _, err := ch.QueueDeclare(dst, true, false, false, false, dstArgs); err != nil {
		return run, err
	}
	_ = ch.Close()
	if _, err := e.fillQueue(src, n, func(i int) amqp.Publishing { return benchPublishing(i, nil) }); err != nil {
		return run, err
	}
	tr := newTracker(n)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, consumers+1)
	copyOf := func(d amqp.Delivery) amqp.Publishing {
		return amqp.Publishing{Headers: d.Headers, Body: d.Body, DeliveryMode: amqp.Persistent,
			ContentType: d.ContentType, MessageId: d.MessageId}
	}
	for c := range consumers {
		cch, err := conn.Channel()
		if err != nil {
			return run, err
		}
		if err := cch.Qos(256, 0, false); err != nil {
			return run, err
		}
		pch, err := conn.Channel()
		if err != nil {
			return run, err
		}
		if err := pch.Confirm(false); err != nil {
			return run, err
		}
		confirms := pch.NotifyPublish(make(chan amqp.Confirmation, 512))
		deliveries, err := cch.Consume(src, fmt.Sprintf("raw-%d", c), false, false, false, false, nil)
		if err != nil {
			return run, err
		}
		wg.Add(1)
		if !pipelined {
			go func() {
				defer wg.Done()
				for {
					select {
					case <-ctx.Done():
						return
					case d, ok := <-deliveries:
						if !ok {
							return
						}
						if err := pch.PublishWithContext(ctx, "", dst, true, false, copyOf(d)); err != nil {
							errc <- err
							return
						}
						if cf := <-confirms; !cf.Ack {
							errc <- errors.New("raw publish nacked")
							return
						}
						if err := d.Ack(false); err != nil {
							errc <- err
							return
						}
						tr.hit()
					}
				}
			}()
			continue
		}
		tags := make(chan uint64, 1024) // consumer delivery tags in publish order
		go func() {                     // acker: confirms arrive in publish order, one per message
			for cf := range confirms {
				tag := <-tags
				if !cf.Ack {
					errc <- errors.New("raw publish nacked")
					return
				}
				if err := cch.Ack(tag, false); err != nil {
					errc <- err
					return
				}
				tr.hit()
			}
		}()
		go func() {
			defer wg.Done()
			for {
				select {
				case <-ctx.Done():
					return
				case d, ok := <-deliveries:
					if !ok {
						return
					}
					tags <- d.DeliveryTag
					if err := pch.PublishWithContext(ctx, "", dst, true, false, copyOf(d)); err != nil {
						errc <- err
						return
					}
				}
			}
		}()
	}
	select {
	case <-tr.done:
	case err := <-errc:
		return run, err
	case <-time.After(time.Duration(n/50+60) * time.Second):
		return run, fmt.Errorf("raw %s: only %d of %d", mode, tr.count.Load(), n)
	}
	cancel()
	_ = conn.Close()
	wg.Wait()
	return retryPathRun{Mode: mode, Handlers: consumers, Messages: n, Rate: tr.rate(), SpanS: tr.span().Seconds()}, nil
}

func (b *bench) scenarioRetryPath() error {
	n := b.size("retry", 5000)
	res := &retryPathResult{Ratios: map[string]float64{}, ModeRatios: map[string]float64{}, ModeRatiosQuorum: map[string]float64{}}
	b.summary.RetryPath = res
	native := b.env.nativeSupported()
	if !native {
		res.NativeUnavailable = nativeNA
	}
	sc := "3 retry path"
	b.row(sc, "setup", fmt.Sprintf("%d msgs, each fails once, retry delay 1m (nothing comes back while measured); prefetch 256; rate of RetryScheduled", n), "", "")
	// The publish path against the comparable raw ceiling: N consumers, one
	// confirm at a time each.
	best := map[string]retryPathRun{}
	for _, h := range b.retryHandlers {
		lib, err := b.retryLib("rabbitretry", n, h)
		if err != nil {
			return err
		}
		raw, err := b.retryRaw(n, h, false, false)
		if err != nil {
			return err
		}
		logf("retry path, %d handler(s): library (publish path) %.0f retries/s, raw one-confirm-at-a-time %.0f/s", h, lib.Rate, raw.Rate)
		res.Runs = append(res.Runs, lib, raw)
		ratio := lib.Rate / raw.Rate
		res.Ratios[fmt.Sprint(h)] = ratio
		b.row(sc, fmt.Sprintf("rabbitretry (publish path), %d handler(s)", h), fmtRate(lib.Rate), "", "")
		b.row(sc, fmt.Sprintf("raw amqp091, %d consumer(s), one confirm at a time each", h), fmtRate(raw.Rate), "", "")
		b.row(sc, fmt.Sprintf("ratio rabbitretry (publish path) / raw one-at-a-time, %d handler(s) (comparable)", h), fmt.Sprintf("%.2f", ratio), ">= 0.5", passMiss(ratio >= 0.5))
		if lib.Rate > best["rabbitretry"].Rate {
			best["rabbitretry"] = lib
		}
	}
	// The nack modes, at the same handler counts.
	rates, settled, settledRates := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	for _, m := range retryModes[1:] {
		if m.mode == "rabbitretry-native" && !native {
			continue
		}
		for _, h := range b.retryHandlers {
			lib, err := b.retryLib(m.mode, n, h)
			if err != nil {
				return err
			}
			logf("retry path, %d handler(s): %s %.0f retries/s", h, m.mode, lib.Rate)
			res.Runs = append(res.Runs, lib)
			rates[m.mode] = append(rates[m.mode], lib.Rate)
			if lib.SettledS > 0 {
				settled[m.mode] = append(settled[m.mode], lib.SettledS)
				settledRates[m.mode] = append(settledRates[m.mode], lib.SettledRate)
			}
			if lib.Rate > best[m.mode].Rate {
				best[m.mode] = lib
			}
		}
	}
	// The raw pipelined ceilings, measured after the library runs.
	pipe, err := b.retryRaw(n, 1, true, false)
	if err != nil {
		return err
	}
	pipeQ, err := b.retryRaw(n, 1, true, true)
	if err != nil {
		return err
	}
	logf("retry path: raw pipelined %.0f/s (classic), %.0f/s (quorum)", pipe.Rate, pipeQ.Rate)
	res.Runs = append(res.Runs, pipe, pipeQ)
	res.RatioVsPipelined = best["rabbitretry"].Rate / pipe.Rate
	// The goal compares to the higher of the two ceilings.
	ceiling, ceilingName := pipe, "classic"
	if pipeQ.Rate > pipe.Rate {
		ceiling, ceilingName = pipeQ, "quorum"
	}
	res.CeilingQueueType = ceilingName
	b.row(sc, "raw amqp091, 1 consumer, pipelined confirms (<= 256 in flight), classic queues", fmtRate(pipe.Rate), "", "")
	b.row(sc, "raw amqp091, 1 consumer, pipelined confirms, quorum source and destination (info)", fmtRate(pipeQ.Rate), "", "")
	hs := fmtInts(b.retryHandlers)
	other, otherRate := "quorum", pipeQ.Rate
	if ceilingName == "quorum" {
		other, otherRate = "classic", pipe.Rate
	}
	for _, m := range retryModes {
		goalName := fmt.Sprintf("rabbitretry %s: best / raw pipelined ceiling (%s queues, the higher of the two)", m.short, ceilingName)
		if m.mode == "rabbitretry-native" && !native {
			b.row(sc, fmt.Sprintf("rabbitretry %s: %s handler(s)", m.name, hs), nativeNA, "", "")
			b.row(sc, goalName, nativeNA, ">= 0.5", "n/a")
			continue
		}
		bm := best[m.mode]
		if m.mode != "rabbitretry" {
			v := fmtRatesUnit(rates[m.mode])
			if len(settled[m.mode]) > 0 {
				v += fmt.Sprintf(" (broker side: the wait queue held them all %s s after the first nack: %s)",
					strings.ReplaceAll(fmtSecs(settled[m.mode]), ", ", " / "), fmtRatesUnit(settledRates[m.mode]))
			}
			b.row(sc, fmt.Sprintf("rabbitretry %s: %s handler(s)", m.name, hs), v, "", "")
		}
		ratio := bm.Rate / ceiling.Rate
		res.ModeRatios[m.mode] = ratio
		res.ModeRatiosQuorum[m.mode] = bm.Rate / pipeQ.Rate
		b.row(sc, goalName, fmt.Sprintf("%.2f (%s at %d handler(s); vs %s ceiling %.2f)", ratio, fmtRate(bm.Rate), bm.Handlers, other, bm.Rate/otherRate),
			">= 0.5", passMiss(ratio >= 0.5))
	}
	return nil
}

func fmtSecs(xs []float64) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprintf("%.2f", x)
	}
	return strings.Join(parts, ", ")
}

func fmtInts(xs []int) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = fmt.Sprint(x)
	}
	return strings.Join(parts, " / ")
}

// fmtRatesUnit is "1234 / 5678 msg/s".
func fmtRatesUnit(xs []float64) string {
	return strings.ReplaceAll(fmtRates(xs), ", ", " / ") + " msg/s"
}
