package main

// methodNotes is appended to the Markdown report: how each figure is
// measured, so the table can be read without the source.
const methodNotes = `
## How the figures are measured

All scenarios run in one process against one broker on the same host; each
uses its own queues and exchanges (` + "`bench.<run-id>.…`" + `), deleted afterwards.
Messages are ~128-byte persistent JSON bodies with the Watermill UUID header;
queues are pre-filled with publisher confirms (pipelined, 1,024 in flight)
before the router starts. Rates are (messages - 1) / (last event - first
event), so router start-up is excluded. One watermill-amqp subscription
(handler) processes one message at a time.

1. **overhead**: a no-op handler on a bare watermill-amqp router vs the same
   router with ` + "`retry.Middleware`" + ` and ` + "`retry.SubscriberConfig()`" + ` (x-death-aware
   Marshaler, retry topology), no failures, 1 handler. Runs alternate
   bare/retry (order flipped every round); the median is the goal figure.
   "client CPU per msg" is this process's user+system CPU (getrusage) from
   router start to the last message, divided by the messages: less sensitive
   to other load on the machine than wall-clock rates. "best-of-runs" divides
   the best retry run by the best bare run (other load only slows runs down).
2. **failure storm**: 2,000 pre-filled messages, every 10th fails once with
   a transient error. rabbitretry, three modes: the publish path on classic
   queues (library defaults: MaxAttempts 5, DefaultBackoff 1 s ×2 ±50%
   jitter → tiers 1s/2s/4s/8s; every retry a confirmed copy to a wait
   queue), quorum queues with ` + "`DeadLetterFirstRetry`" + ` (a first-tier retry is a
   nack that the broker dead-letters into the 1 s wait queue) and quorum
   queues with ` + "`NativeDelayedRetry{Min: 1s, Max: 2s}`" + ` (RabbitMQ 4.3+: a retry
   is a nack with requeue and the queue holds the message for Min = 1 s;
   Max is 2 s so that every jittered first delay, at most 1.5 s, is within
   it). Each mode runs 5 times with and 5 times without failures,
   interleaved; the figures are medians. Watermill:
   ` + "`middleware.Retry{MaxRetries: 3, InitialInterval: time.Second}`" + ` inside
   ` + "`middleware.PoisonQueue`" + ` (poison published with a watermill-amqp publisher),
   one run. Same subscriber config for all (prefetch 256, same handler count).
   *Backlog drain* = first handler call to the last message's first attempt;
   *complete* = to the last success (retries included; it includes the ≥1 s
   broker wait). The drain-rate goal uses the backlog drain, with and
   without failures on the same queue type.
   Healthy latency = handler time of a never-failing message minus the publish
   timestamp carried in a header set at publish (it includes the pre-fill and
   router start, identical for all).
3. **retry path**: 5,000 messages, each fails its first attempt with a
   1-minute retry delay, so nothing comes back while measured. Counted:
   Observer.RetryScheduled, first to last. Publish path (classic): the chain
   publishes the copy (with confirm) to the 1-minute wait queue, then acks.
   DeadLetterFirstRetry (quorum): the chain nacks, the broker dead-letters
   the message into the 1-minute wait queue (asynchronously: the row also
   gives the time until the wait queue held them all). NativeDelayedRetry
   (quorum, Min = Max = 1 min): the chain nacks with requeue, the queue
   holds the message. For the nack modes RetryScheduled is called just
   before the nack is sent. Raw ceiling with amqp091
   only: consume (prefetch 256) → publish body+headers (persistent,
   mandatory) to a durable 1-minute-TTL queue → wait for the confirm → ack.
   "one confirm at a time" uses N consumers, each with its own consume and
   confirm channel, serially: that is what N watermill-amqp subscriptions do,
   so it is the comparable ceiling for the publish path (the library shares
   its 2 publisher channels between handlers). "pipelined" publishes every
   delivery at once and acks on confirm (≤256 in flight), on classic and on
   quorum queues (source and destination); each mode's best rate (over the
   handler counts) is compared with the higher of the two.
4. **delay accuracy**: tiers 200ms/1s/3s, 200 messages each. The handler
   fails attempt 1 with RetryAfter(tier) (backoff 1 ms, so the tier is exact)
   and succeeds on attempt 2. Observed delay = handler start of attempt 2
   minus the moment attempt 1 returned (includes the confirmed publish, TTL,
   dead-lettering, loop-back and delivery). The queue is filled 3s-tier
   first, then 1s, then 200ms: a 200ms message observed > 300 ms would be
   head-of-line blocking. Native delayed retry: a quorum queue with
   ` + "`NativeDelayedRetry{Min: 1s, Max: 1s}`" + `, 200 messages published paced (10
   every 50 ms, like the 200ms tier) while the consumer runs; each fails
   once (nack with requeue) and the error is observed − Min.
5. **memory**: a consumer (router + retry chain) on an empty queue; VmRSS,
   Go heap in use and runtime.NumGoroutine are sampled (max of 5 samples, no
   forced GC); a child process then publishes 100,000 retry-like messages
   into the consumer's 10-minute wait queue through the wait exchange; the
   consumer is sampled again (max of 15 samples). The broker's memory for
   that queue is read with ` + "`rabbitmqctl list_queues name memory messages`" + `, the
   node's before and after with ` + "`rabbitmqctl status`" + ` (memory.total: erlang,
   rss), both through ` + "`$RABBITRETRY_CTL`" + ` when set. Native delayed retry: a quorum
   queue declared with ` + "`NativeDelayedRetry{Min: 10m, Max: 10m}`" + ` is filled with
   100,000 messages (node memory read before and after), a consumer failing
   every message nacks them all into the delayed state, and once the
   management API (` + "`GET /api/queues/<vhost>/<name>`" + `, refreshed every 5 s) reports
   them all as ` + "`messages_delayed`" + ` the queue's and the node's memory are read
   again. The delayed messages are originals (no retry headers); the wait
   queue holds copies with the retry headers. The queue's memory is its own
   process (for a quorum queue, its Ra server: the per-message state of
   ready and delayed messages); the node's figures also move with what is
   shared, e.g. ` + "`quorum_ets`" + ` (Ra's in-memory log tables, node-wide) and what the
   allocators keep from earlier scenarios, so they are read at one moment
   and are indicative only.
6. **concurrency**: the retry chain, no failures, 20,000 messages, with 1, 2,
   4, 8 handlers on the same topic (each its own subscription and channel on
   the same queue, prefetch 256 each), one run each.

The machine is shared: other processes (compilers, test runs) compete for
the same cores as the broker and the bench, so short wall-clock drains
(0.5–1.5 s) vary a lot between runs; see the per-run figures.
`
