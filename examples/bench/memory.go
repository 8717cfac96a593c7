package main

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

const memoryTier = 10 * time.Minute

type memSample struct {
	RSSMiB     float64 `json:"rss_mib"`
	HeapMiB    float64 `json:"heap_inuse_mib"`
	Goroutines int     `json:"goroutines"`
}

type memoryResult struct {
	Waiting        int       `json:"waiting_messages"`
	Before         memSample `json:"before"`
	After          memSample `json:"after"`
	DeltaRSSMiB    float64   `json:"delta_rss_mib"`
	DeltaGoroutine int       `json:"delta_goroutines"`
	FillS          float64   `json:"fill_s"`
	BrokerQueueMiB float64   `json:"broker_wait_queue_memory_mib,omitempty"`
	// Broker node memory (rabbitmqctl status) before the fill and with the
	// messages waiting; absent when the control command does not reach the
	// bench's broker (see ctlPrefix).
	NodeBefore *nodeMemory `json:"broker_node_before,omitempty"`
	NodeAfter  *nodeMemory `json:"broker_node_waiting,omitempty"`
	// Native: the same number of messages held in a quorum queue's delayed
	// state (RabbitMQ 4.3+); absent (NativeUnavailable set) on older brokers.
	Native            *memoryNativeResult `json:"native,omitempty"`
	NativeUnavailable string              `json:"native_unavailable,omitempty"`
}

func (b *bench) scenarioMemory() error {
	if err := b.memoryWaitQueue(); err != nil {
		return err
	}
	return b.memoryNative()
}

// sampleMem takes the largest RSS (and the matching heap and goroutine
// count) over k samples 200 ms apart, without forcing a GC: what the
// consumer process really holds.
func sampleMem(k int) memSample {
	var best memSample
	for i := range k {
		if i > 0 {
			time.Sleep(200 * time.Millisecond)
		}
		rss, _ := vmRSS()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		s := memSample{RSSMiB: float64(rss) / (1 << 20), HeapMiB: float64(ms.HeapInuse) / (1 << 20), Goroutines: runtime.NumGoroutine()}
		if s.RSSMiB >= best.RSSMiB {
			best = s
		}
	}
	return best
}

// memoryWaitQueue: a consumer (router + retry chain, one handler) runs on an
// empty queue; RSS and goroutines are sampled; then a child process
// publishes N messages straight into the consumer's 10-minute wait queue
// through amqpretry's wait exchange (as retries would be), and the consumer
// is sampled again while they wait. The publishing runs in a child process
// so that its buffers are not counted against the consumer. The broker's
// memory for the wait queue (rabbitmqctl list_queues) and the node's
// (rabbitmqctl status) before and after the fill are read with the control
// command (ctlPrefix).
func (b *bench) memoryWaitQueue() (err error) {
	e := b.env
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	n := b.size("memory", 100000)
	q := e.name("mem", watermillShort())
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = 256
	retry, err := amqpretry.New(amqpretry.Config{Subscriber: cfg, Naming: e.naming("mem"), Logger: e.logger,
		Mode: amqpretry.Tiers(memoryTier)})
	if err != nil {
		return err
	}
	defer func() { _ = retry.Close() }()
	e.trackRetry(retry, q)
	sub, err := wamqp.NewSubscriber(retry.SubscriberConfig(), e.logger)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Close() }()
	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: 1, middlewares: []message.HandlerMiddleware{retry.Middleware},
		handler: func(*message.Message) error { return nil }})
	if err != nil {
		return err
	}
	defer func() {
		if cerr := rr.close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	time.Sleep(time.Second)
	res := &memoryResult{Waiting: n}
	b.summary.Memory = res
	res.Before = sampleMem(5)

	wq := retry.Topology().WaitQueues(q)[0]
	nodeBefore, nodeOK := readNodeMemory()
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	start := time.Now()
	cmd := exec.Command(exe, "-uri", e.uri, "-fill-child", strings.Join([]string{retry.Topology().Naming().WaitExchange, wq, strconv.Itoa(n), q}, ","))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("fill child: %w", err)
	}
	res.FillS = time.Since(start).Seconds()
	if got, err := e.queueLen(wq); err != nil || got != n {
		return fmt.Errorf("wait queue %s holds %d messages (err %v), expected %d", wq, got, err, n)
	}
	time.Sleep(time.Second)
	res.After = sampleMem(15)
	res.DeltaRSSMiB = res.After.RSSMiB - res.Before.RSSMiB
	res.DeltaGoroutine = res.After.Goroutines - res.Before.Goroutines
	if st, ok := brokerQueueStats(wq); ok {
		// The control command lists this run's queue: it reaches this broker.
		res.BrokerQueueMiB = mib(st.MemoryBytes)
		if after, ok := readNodeMemory(); ok && nodeOK {
			res.NodeBefore, res.NodeAfter = &nodeBefore, &after
		}
	} else {
		logf("memory: %s does not list %s (not installed, or another broker than -uri: set RABBITRETRY_CTL); no broker figures", strings.Join(ctlPrefix(), " "), wq)
	}
	logf("memory: before %.1f MiB RSS / %d goroutines, with %d waiting %.1f MiB / %d goroutines (fill %.1fs)",
		res.Before.RSSMiB, res.Before.Goroutines, n, res.After.RSSMiB, res.After.Goroutines, res.FillS)

	sc := "5 memory"
	b.row(sc, "consumer RSS / heap / goroutines, 0 waiting", fmt.Sprintf("%.1f MiB / %.1f MiB / %d", res.Before.RSSMiB, res.Before.HeapMiB, res.Before.Goroutines), "", "")
	b.row(sc, fmt.Sprintf("same with %d waiting in the 10m wait queue", n), fmt.Sprintf("%.1f MiB / %.1f MiB / %d", res.After.RSSMiB, res.After.HeapMiB, res.After.Goroutines), "", "")
	b.row(sc, "delta RSS / goroutines", fmt.Sprintf("%+.1f MiB / %+d", res.DeltaRSSMiB, res.DeltaGoroutine), "<= 20 MiB", passMiss(res.DeltaRSSMiB <= 20))
	if res.BrokerQueueMiB > 0 {
		b.row(sc, fmt.Sprintf("broker, %d in the classic 10m wait queue: queue memory (list_queues); node memory (status) vs empty, info", n),
			fmtBrokerMem(res.BrokerQueueMiB, res.NodeBefore, res.NodeAfter), "", "")
	}
	return nil
}

// fmtBrokerMem is "queue 7.3 MiB; node erlang +26.9 MiB, rss +7.4 MiB
// (erlang 72.9 -> 99.8, rss 189.0 -> 196.4)": Erlang's own allocation is
// the steadier figure; rss includes what the allocators keep from earlier
// scenarios.
func fmtBrokerMem(queueMiB float64, before, after *nodeMemory) string {
	s := fmt.Sprintf("queue %.1f MiB", queueMiB)
	if before != nil && after != nil {
		s += fmt.Sprintf("; node erlang %+.1f MiB, rss %+.1f MiB (erlang %.1f -> %.1f, rss %.1f -> %.1f)",
			mib(after.Erlang-before.Erlang), mib(after.RSS-before.RSS), mib(before.Erlang), mib(after.Erlang), mib(before.RSS), mib(after.RSS))
	}
	return s
}

// fmtDur prints whole minutes as "10m", not "10m0s".
func fmtDur(d time.Duration) string {
	if d >= time.Minute && d%time.Minute == 0 {
		return fmt.Sprintf("%dm", d/time.Minute)
	}
	return d.String()
}

// fillChild is the child process of scenarioMemory: spec is
// "exchange,routingKey,n,originQueue". Messages look like retry copies
// (attempt 2, failure metadata) so the broker holds realistic sizes.
func fillChild(uri, spec string) error {
	parts := strings.Split(spec, ",")
	if len(parts) != 4 {
		return fmt.Errorf("bad -fill-child %q", spec)
	}
	n, err := strconv.Atoi(parts[2])
	if err != nil {
		return err
	}
	conn, err := amqp.Dial(uri)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	now := time.Now().UTC().Format(time.RFC3339Nano)
	_, err = fill(conn, parts[0], parts[1], n, func(i int) amqp.Publishing {
		return benchPublishing(i, amqp.Table{
			middleware.AttemptKey: "2", middleware.FirstFailureKey: now, middleware.LastFailureKey: now,
			middleware.LastErrorKey: errTransient.Error(), middleware.ErrorClassKey: middleware.ClassTransient,
			middleware.OriginalQueueKey: parts[3], middleware.DelayKey: strconv.FormatInt(memoryTier.Milliseconds(), 10),
		})
	})
	return err
}
