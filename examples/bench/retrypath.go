package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// retryTier is the single wait tier of the retry-path scenario: long enough
// that no copy comes back while the scenario measures (copies are deleted
// with the queues afterwards).
const retryTier = time.Minute

type retryPathRun struct {
	Mode     string  `json:"mode"` // "rabbitretry", "raw-serial", "raw-pipelined"
	Handlers int     `json:"handlers"`
	Messages int     `json:"messages"`
	Rate     float64 `json:"retries_per_s"`
	SpanS    float64 `json:"span_s"`
}

type retryPathResult struct {
	Runs []retryPathRun `json:"runs"`
	// Ratios of the library to the comparable raw ceiling (raw-serial with
	// the same number of consumers), by handler count.
	Ratios map[string]float64 `json:"ratio_vs_raw_serial_by_handlers"`
	// RatioVsPipelined is the library (at the most handlers) over the
	// pipelined raw ceiling (one consumer, up to prefetch confirms in flight).
	RatioVsPipelined float64 `json:"ratio_best_vs_raw_pipelined"`
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

// retryLib: every message fails its first attempt; the chain publishes the
// copy to the 1-minute wait queue with a confirm, then acks. Measured: the
// rate of RetryScheduled from the first to the last.
func (b *bench) retryLib(n, handlers int) (run retryPathRun, err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	q := e.name("retry", "lib", fmt.Sprintf("h%d", handlers), watermillShort())
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = 256
	tr := newTracker(n)
	retry, err := amqpretry.New(amqpretry.Config{
		Subscriber: cfg, Naming: e.naming("retry"), Logger: e.logger,
		Tiers:    []time.Duration{retryTier},
		Backoff:  func() backoff.BackOff { return backoff.NewConstantBackOff(retryTier) },
		Observer: retryObserver{t: tr},
	})
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
	werr := tr.wait(time.Duration(n/50+60)*time.Second, "retry path (library)")
	if cerr := rr.close(); cerr != nil && werr == nil {
		werr = cerr
	}
	if werr != nil {
		return run, werr
	}
	if got, err := e.queueLen(retry.Topology().WaitQueues(q)[0]); err == nil && got != n {
		logf("retry path: wait queue holds %d messages, expected %d", got, n)
	}
	return retryPathRun{Mode: "rabbitretry", Handlers: handlers, Messages: n, Rate: tr.rate(), SpanS: tr.span().Seconds()}, nil
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
func (b *bench) retryRaw(n, consumers int, pipelined bool) (run retryPathRun, err error) {
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
	if _, err := ch.QueueDeclare(src, true, false, false, false, nil); err != nil {
		return run, err
	}
	if _, err := ch.QueueDeclare(dst, true, false, false, false, amqp.Table{"x-message-ttl": retryTier.Milliseconds()}); err != nil {
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
	res := &retryPathResult{Ratios: map[string]float64{}}
	b.summary.RetryPath = res
	sc := "3 retry path"
	b.row(sc, "setup", fmt.Sprintf("%d msgs, each fails once; copy -> 1m wait queue with confirm; prefetch 256", n), "", "")
	var best retryPathRun
	for _, h := range b.retryHandlers {
		lib, err := b.retryLib(n, h)
		if err != nil {
			return err
		}
		raw, err := b.retryRaw(n, h, false)
		if err != nil {
			return err
		}
		logf("retry path, %d handler(s): library %.0f retries/s, raw one-confirm-at-a-time %.0f/s", h, lib.Rate, raw.Rate)
		res.Runs = append(res.Runs, lib, raw)
		ratio := lib.Rate / raw.Rate
		res.Ratios[fmt.Sprint(h)] = ratio
		b.row(sc, fmt.Sprintf("rabbitretry, %d handler(s)", h), fmtRate(lib.Rate), "", "")
		b.row(sc, fmt.Sprintf("raw amqp091, %d consumer(s), one confirm at a time each", h), fmtRate(raw.Rate), "", "")
		b.row(sc, fmt.Sprintf("ratio rabbitretry / raw one-at-a-time, %d handler(s) (comparable)", h), fmt.Sprintf("%.2f", ratio), ">= 0.5", passMiss(ratio >= 0.5))
		if lib.Rate > best.Rate {
			best = lib
		}
	}
	pipe, err := b.retryRaw(n, 1, true)
	if err != nil {
		return err
	}
	logf("retry path: raw pipelined %.0f/s", pipe.Rate)
	res.Runs = append(res.Runs, pipe)
	res.RatioVsPipelined = best.Rate / pipe.Rate
	b.row(sc, "raw amqp091, 1 consumer, pipelined confirms (<= 256 in flight)", fmtRate(pipe.Rate), "", "")
	b.row(sc, fmt.Sprintf("ratio best rabbitretry (%d handlers) / raw pipelined (not comparable: info)", best.Handlers),
		fmt.Sprintf("%.2f", res.RatioVsPipelined), "", "")
	return nil
}
