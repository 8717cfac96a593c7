package main

import (
	"fmt"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/router"
)

// mgmtQueueStats are the figures the management API reports for a queue
// (GET /api/queues/<vhost>/<name>), refreshed by the broker every 5 s
// (collect_statistics_interval); -1 when a field is absent. RabbitMQ 4.3
// reports the delayed messages of a quorum queue as "messages_delayed";
// "messages" counts them, "messages_ready" does not (nor does the
// message count of a passive queue.declare).
type mgmtQueueStats struct {
	Messages     int64 `json:"messages"`
	Ready        int64 `json:"messages_ready"`
	Unacked      int64 `json:"messages_unacknowledged"`
	Delayed      int64 `json:"messages_delayed"`
	MessageBytes int64 `json:"message_bytes"`
	Memory       int64 `json:"memory"`
}

func readMgmtQueue(uri, q string) (mgmtQueueStats, error) {
	m, err := mgmtQueue(uri, q)
	if err != nil {
		return mgmtQueueStats{}, err
	}
	get := func(k string) int64 {
		if v, ok := m[k].(float64); ok {
			return int64(v)
		}
		return -1
	}
	return mgmtQueueStats{Messages: get("messages"), Ready: get("messages_ready"), Unacked: get("messages_unacknowledged"),
		Delayed: get("messages_delayed"), MessageBytes: get("message_bytes"), Memory: get("memory")}, nil
}

type memoryNativeResult struct {
	Held     int     `json:"held_messages"`
	MinS     float64 `json:"native_min_s"`
	FillS    float64 `json:"fill_s"`
	NackS    float64 `json:"nack_all_s"` // first to last RetryScheduled
	NackRate float64 `json:"nack_per_s"`
	// Queue memory and message count from rabbitmqctl list_queues (live)
	// with the messages ready (before the consumer) and delayed.
	QueueReadyMiB   float64 `json:"queue_memory_ready_mib,omitempty"`
	QueueDelayedMiB float64 `json:"queue_memory_delayed_mib,omitempty"`
	QueueMessages   int64   `json:"queue_messages_delayed_state,omitempty"`
	// The management API's view once every message is delayed.
	Mgmt      *mgmtQueueStats `json:"management_api,omitempty"`
	MgmtError string          `json:"management_api_error,omitempty"`
	// Node memory: before the fill, with the messages ready, and delayed.
	NodeBefore  *nodeMemory `json:"broker_node_before,omitempty"`
	NodeReady   *nodeMemory `json:"broker_node_ready,omitempty"`
	NodeDelayed *nodeMemory `json:"broker_node_delayed,omitempty"`
}

// memoryNativeHold is Min = Max of the native delayed retry here: long
// enough that nothing comes back while the memory is read.
const memoryNativeHold = 10 * time.Minute

// memoryNative: broker memory with N messages held in the delayed state of
// a quorum queue (RabbitMQ 4.3+ native delayed retry). The queue is
// declared by amqpretry with NativeDelayedRetry{Min: Max: 10m}, filled
// with N messages (the node's memory is read before and after the fill), then a
// consumer whose handler fails every message nacks them all into the
// delayed state (counted by Observer.RetryScheduled). Once the management
// API reports every message delayed (it refreshes every 5 s), the queue's
// memory (rabbitmqctl list_queues), the management API's figures and the
// node's memory (rabbitmqctl status) are read. Compare with the same
// number of messages in a classic wait queue (memoryWaitQueue); the native
// path holds the original message (no retry headers), the wait queue a copy
// with the retry headers.
func (b *bench) memoryNative() (err error) {
	e := b.env
	res := b.summary.Memory
	sc := "5 memory"
	n := b.size("memory", 100000)
	name := fmt.Sprintf("%d held in the native delayed state (quorum, Min = Max = %s)", n, fmtDur(memoryNativeHold))
	if !e.nativeSupported() {
		res.NativeUnavailable = nativeNA
		b.row(sc, "broker: "+name, nativeNA, "", "")
		return nil
	}
	defer func() {
		if cerr := e.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	q := e.name("mem", "native", watermillShort())
	cfg := wamqp.NewDurableQueueConfig(e.uri)
	cfg.Consume.Qos.PrefetchCount = 256
	tr := newTracker(n)
	retry, sub, closeAll, err := e.retryConsumer(amqpretry.Config{Subscriber: cfg, Naming: e.naming("memnative"), Logger: e.logger,
		QueueType: amqpretry.QueueTypeQuorum,
		Mode: amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: memoryNativeHold, Max: memoryNativeHold,
			Tiers: []time.Duration{memoryNativeHold}}),
		Policy: router.Policy{Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(memoryNativeHold) }, Observer: retryObserver{t: tr}},
	}, q)
	if err != nil {
		return err
	}
	defer closeAll()
	nr := &memoryNativeResult{Held: n, MinS: memoryNativeHold.Seconds()}
	res.Native = nr
	before, nodeOK := readNodeMemory()
	fillTook, err := e.fillQueue(q, n, func(i int) amqp.Publishing { return benchPublishing(i, nil) })
	if err != nil {
		return err
	}
	nr.FillS = fillTook.Seconds()
	st, ctlOK := brokerQueueStats(q)
	if ctlOK {
		// The control command lists this run's queue: it reaches this broker.
		nr.QueueReadyMiB = mib(st.MemoryBytes)
		if ready, ok := readNodeMemory(); ok && nodeOK {
			nr.NodeBefore, nr.NodeReady = &before, &ready
		}
	} else {
		logf("memory native: %s does not list %s (not installed, or another broker than -uri: set RABBITRETRY_CTL); no rabbitmqctl figures",
			strings.Join(ctlPrefix(), " "), q)
	}

	rr, err := e.startRouter(consumer{sub: sub, topic: q, handlers: 1, middlewares: []message.HandlerMiddleware{retry.Middleware},
		handler: func(*message.Message) error { return errTransient }})
	if err != nil {
		return err
	}
	werr := tr.wait(time.Duration(n/200+60)*time.Second, "memory native: nacking every message")
	if cerr := rr.close(); cerr != nil && werr == nil {
		werr = cerr
	}
	if werr != nil {
		return werr
	}
	nr.NackS, nr.NackRate = tr.span().Seconds(), tr.rate()
	logf("memory native: %d messages filled in %.1fs, nacked into the delayed state in %.1fs (%.0f/s)", n, nr.FillS, nr.NackS, nr.NackRate)
	// The last nacks may still be on their way, and the management API
	// refreshes its figures every 5 s: poll it until every message is
	// delayed (or it stops moving, on a broker without that field).
	var ms mgmtQueueStats
	for deadline := time.Now().Add(30 * time.Second); ; {
		ms, err = readMgmtQueue(e.uri, q)
		if err != nil {
			nr.MgmtError = err.Error()
			logf("memory native: management API: %v", err)
			break
		}
		if ms.Delayed >= int64(n) || time.Now().After(deadline) {
			nr.Mgmt = &ms
			break
		}
		time.Sleep(time.Second) // polling the management API
	}
	if st, ok := brokerQueueStats(q); ok {
		nr.QueueDelayedMiB, nr.QueueMessages = mib(st.MemoryBytes), st.Messages
		if delayed, ok := readNodeMemory(); ok && nr.NodeReady != nil {
			nr.NodeDelayed = &delayed
		}
	}

	if nr.QueueDelayedMiB > 0 {
		b.row(sc, fmt.Sprintf("broker, %d ready in the quorum queue: queue memory (list_queues); node memory (status) vs empty, info", n),
			fmtBrokerMem(nr.QueueReadyMiB, nr.NodeBefore, nr.NodeReady), "", "")
		b.row(sc, "broker, "+name+": queue memory (list_queues); node memory (status) vs empty, info",
			fmtBrokerMem(nr.QueueDelayedMiB, nr.NodeBefore, nr.NodeDelayed), "", "")
	}
	if nr.QueueDelayedMiB > 0 && res.BrokerQueueMiB > 0 && res.Waiting > 0 {
		perMsg := func(m float64, k int) float64 { return m * (1 << 20) / float64(k) }
		b.row(sc, "broker, queue memory per message: classic wait queue / quorum ready / native delayed (list_queues memory / messages, info)",
			fmt.Sprintf("%.0f / %.0f / %.0f bytes", perMsg(res.BrokerQueueMiB, res.Waiting), perMsg(nr.QueueReadyMiB, n), perMsg(nr.QueueDelayedMiB, n)), "", "")
	}
	if nr.NodeDelayed != nil {
		b.row(sc, "broker, quorum queue: node quorum_ets / quorum_queue_procs, empty -> ready -> delayed (status, info)",
			fmt.Sprintf("%.1f -> %.1f -> %.1f MiB / %.1f -> %.1f -> %.1f MiB", mib(nr.NodeBefore.QuorumETS), mib(nr.NodeReady.QuorumETS), mib(nr.NodeDelayed.QuorumETS),
				mib(nr.NodeBefore.QuorumProcs), mib(nr.NodeReady.QuorumProcs), mib(nr.NodeDelayed.QuorumProcs)), "", "")
	}
	if nr.Mgmt != nil {
		m := nr.Mgmt
		b.row(sc, "broker, "+name+": management API messages / ready / unacked / delayed; message_bytes; memory",
			fmt.Sprintf("%d / %d / %d / %d; %.1f MiB; %.1f MiB", m.Messages, m.Ready, m.Unacked, m.Delayed, mib(m.MessageBytes), mib(m.Memory)), "", "")
	}
	b.row(sc, fmt.Sprintf("native: fill %d / nack all into the delayed state (1 handler, prefetch 256)", n),
		fmt.Sprintf("%.1f s / %.1f s (%s)", nr.FillS, nr.NackS, fmtRate(nr.NackRate)), "", "")
	return nil
}
