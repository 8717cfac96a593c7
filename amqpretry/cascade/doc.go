// Package cascade is a shared delay topology for RabbitMQ, the "delay
// cascade": a fixed set of exchanges and queues, declared once per vhost,
// that delivers a message to any queue after any delay from one grain up to
// MaxDelay, exact to the grain, with no head-of-line blocking, at-least-once
// with quorum level queues, and with a queue count that does not grow with
// the number of destination queues (a destination costs one binding). It is
// the design of the NServiceBus RabbitMQ transport's delay infrastructure,
// written afresh here.
//
// It offers a retry mode for amqpretry.New (Mode: exact retry delays instead
// of amqpretry's per-queue tiers, which round a delay by up to √2 and make a
// RetryAfter(37s) wait for the next tier up) and a watermill
// message.Publisher for scheduled messages set with Watermill's delay
// component (delay.Message, delay.For, delay.Until, delay.WithContext,
// middleware.DelayOnError).
//
// # Topology
//
// With L levels (Config.Levels) and grain g (Config.Grain):
//
//	level n, n = L-1 .. 0:
//	  exchange "<prefix>.level.NN" (topic)
//	    --("*." × (L-1-n) + "1.#")--> queue "<prefix>.level.NN"
//	                                   x-message-ttl = 2^n × g,
//	                                   x-dead-letter-exchange = level n-1's exchange
//	                                   (level 0: the delivery exchange),
//	                                   no x-dead-letter-routing-key
//	    --("*." × (L-1-n) + "0.#")--> level n-1's exchange (exchange-to-exchange
//	                                   binding; level 0: the delivery exchange)
//	exchange "<prefix>.delivery" (topic)
//	    --("*." × L + Q)--> Q, for each destination queue Q
//
// Routing key: the delay in grains, n = ceil(delay / g), written as its L
// bits, most significant first, one word "0" or "1" each, then the
// destination queue name: with g = 100 ms and L = 26, 1.5 s (15 grains) to
// "orders" is
//
//	0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.1.1.1.1.orders
//
// A delayed message is published to the exchange of the level of its
// highest set bit (the levels above it would only pass it on). At each
// level n
// the key's bit n (word L-1-n) decides: 1, the message waits in level n's
// queue for 2^n × g and is then dead-lettered, with its routing key kept
// (no x-dead-letter-routing-key), to level n-1's exchange; 0, the exchange
// passes it on at once to level n-1's exchange. After level 0 it reaches
// the delivery exchange, whose binding for Q matches exactly the L bit
// words followed by Q's words, so it reaches Q and no other queue (a
// "#.Q" binding would also match the keys of queue "a.Q"). The time spent
// is the sum of 2^n × g over the set bits: n × g, the delay rounded up to
// the grain. A delay of 0 grains is published straight to the delivery
// exchange.
//
// No head-of-line blocking: each level queue has one queue-level TTL, so
// its messages expire in the order they entered (FIFO), and a message
// never waits behind one with a longer delay; per-message TTLs would
// ("Time-To-Live and Expiration": only the head message expires). A
// publisher's per-message expiration is therefore removed from the copy.
//
// Arithmetic and limits: the longest delay, MaxDelay, is (2^L - 1) × g. Level L-1's TTL, 2^(L-1)
// × g, must be at most amqpretry.MaxTTL (2^32-1 ms). Defaults: g = 100 ms
// and L = 26, so MaxDelay = 67,108,863 grains = 6,710,886.3 s ≈ 77.7 days
// (above MaxTTL ≈ 49.7 days) and the top TTL is 3,355,443.2 s. A message
// passes one level queue per set bit of its grain count: at most L hops, 4
// for 30 s (300 = 0b100101100), 1 for any power of two. A routing key has
// at most 255 bytes (AMQP short string), so a destination queue name may
// have 255 - 2L bytes (203 by default), and no word "*" or "#" (topic
// wildcards); see ErrBadQueueName.
//
// Why 100 ms: the broker's TTL expiry and each hop (a quorum queue write
// and its dead-letter worker's confirmed publish) cost a few milliseconds
// on RabbitMQ 3.10 and 4.3 (this package's broker tests measure 1–25 ms of
// total lateness for 0–6 hops on a busy 2-core machine), so a 100 ms grain
// keeps the promise "exact to the grain" with a margin, and a sub-second
// retry (the default backoff starts at 1 s; 500 ms, 1.5 s) keeps its
// value. Finer grains work (1 ms: 32 levels) but buy little; 1 s (23
// levels, as NServiceBus) rounds sub-second delays up to 1 s.
//
// # Delivery guarantees
//
// Level queues are quorum queues by default (Config.QueueType), declared
// with x-dead-letter-strategy at-least-once, which RabbitMQ requires to be
// paired with x-overflow reject-publish ("Quorum Queues", at-least-once
// dead-lettering, RabbitMQ 3.10+): the level queue keeps a message until
// the next level's queue (or the destination) confirmed it, so the cascade
// is at-least-once across node restarts (a duplicate is possible, a loss
// is not). Quorum level queues also carry x-delivery-limit 2^31-1: returns by interrupted censuses count
// against a quorum queue's delivery limit on RabbitMQ 4.x (default 20), and
// a message over it would be dead-lettered to the next level, early.
// Classic queues dead-letter at-most-once ("Dead Letter Exchanges": a
// message expiring while the node stops, or routed nowhere, is lost);
// choose them only where that is acceptable.
//
// Every process sharing a prefix must use the same Levels, Grain and
// QueueType: declaring the cascade first declares a settings marker (an
// exchange "<prefix>.settings") that the broker refuses to redeclare with
// other settings, and returns ErrSettingsMismatch naming both before
// binding anything.
//
// Publishing is mandatory with publisher confirms (amqpretry's
// confirm.Publisher, "Consumer Acknowledgements and Publisher Confirms"):
// Schedule and Publish return nil only once the broker holds the message
// in a level queue, or, for a zero delay, in the destination. Mandatory
// only checks the first hop, so the destination's binding is made before
// the first publish to it (once per queue, cached) and the cascade is
// declared before the first publish at all; a publish that finds either
// missing (unroutable, or 404) redeclares and retries once.
//
// A message addressed to a queue that is unbound or deleted when it leaves
// level 0 is routed nowhere: a classic level queue drops it; a quorum one,
// with at-least-once dead-lettering, keeps it (not counted as ready by
// Waiting) and its dead-letter worker retries it later, so it is delivered
// once the binding exists again, but late: measured on RabbitMQ 3.10 and
// 4.3, a message due after 100 ms and bound 2 s later arrived after 180 s
// (the worker's resend interval, dead_letter_worker_publisher_confirm_timeout,
// 3 min by default). Bind each destination before publishing to it (the
// retry Delayer (Mode) and the Publisher do, once per queue per process) and again after
// recreating a queue (a subscriber's topology builder is a good place).
//
// The same holds between levels: a level queue, level exchange or the
// delivery exchange deleted by an operator leaves the messages above it
// in their level's dead-letter buffer. The retry Delayer and a Publisher check the
// cascade every Config.TopologyCheck (5 s) and declare it again, with their
// destinations' bindings, when a piece is missing, so only messages that
// reached the gap before that wait for the worker's resend; with
// Config.ManagementURL the repair has the workers resend them at once (a
// policy change), and Waiting reports each level's dead-letter backlog
// (LevelCount.DeadLettering) and length limits. A full level (a length
// limit from a policy) refuses publishes: the Delayer and Publisher hold a
// refused message and publish it again, never earlier than asked, and
// hold new messages whose way crosses a level known full
// (Config.FullWait); Waiting shows the level Full. A full level also
// refuses dead-lettering from the level above, whose messages then wait
// for the dead-letter worker's resend (3 min): exclude the levels from
// length-limit policies.
//
// # What the consumer sees
//
// The delivered message keeps its body, properties and headers, plus what
// the broker adds on dead-lettering ("Dead Letter Exchanges"): an x-death
// entry per level queue passed (queue, reason "expired", count, time,
// exchange, routing keys) and the x-first-death-* (and, on 4.x,
// x-last-death-*) headers; the Delayer refuses, wrapping
// middleware.ErrCannotDelay, a copy whose headers could then exceed
// amqpwire.MaxCopyHeaderBytes. Its basic.deliver routing key is the
// cascade key, not the queue name, and its exchange is the one its last
// routing started from (a level exchange, or the delivery exchange): the
// Retry's Marshaler (with Mode) recognises both.
//
// # With amqpretry.New
//
// Mode plugs the cascade into amqpretry.New as its retry mode
// (amqpretry.Config.Mode: cascade.Mode(cfg), an amqpretry.Custom mode):
// retries with a positive delay go
// through the cascade, exact to the grain, and no wait queue is declared;
// zero-delay copies (fallback, RedeliveryGuard) keep amqpretry's loop-back
// exchange; the subscriber's topology builder declares the cascade and
// binds each originating queue on every (re)connect; and the Retry's
// Marshaler counts a delivery from the cascade as a retry-path delivery, so the origin metadata of the first failure is
// kept.
//
// # Operators
//
// Config.Waiting (and Publisher.Waiting) gives each level queue's ready
// count (passive queue.declare): instant, and it touches no message. The
// command rabbitretry-topology does the rest (cascade
// waiting|census|move|redirect|unredirect): counts per destination, with
// the earliest and latest due time, come from its census, which takes the
// waiting messages out of the level queues and puts each back with its
// remaining delay (every message the cascade sends carries its due time in
// header rabbitretry-cascade-due, clamped to what its level and key
// allow), the copy's publish and the original's ack in one transaction, so
// an interrupted census (Ctrl-C, deadline, dropped connection, resource
// alarm) leaves each message put back or untouched, and returns within
// its deadline + about 2 s; move readdresses a queue's waiting messages to
// another queue on the way. Redirect is the instant alternative for a
// decommissioned queue: it binds the new queue with the old one's delivery
// pattern and unbinds the old one, so the waiting messages arrive at the
// new queue when due, untouched; unredirect undoes it. Deleting the level
// queues and exchanges ("<prefix>.level.NN", "<prefix>.delivery",
// "<prefix>.settings") removes the cascade with every waiting message.
//
// RabbitMQ pages relied upon: "Time-To-Live and Expiration" (queue TTL,
// expiry at the head, FIFO), "Dead Letter Exchanges" (dead-lettering keeps
// the routing key without x-dead-letter-routing-key, x-death), "Exchange to
// Exchange Bindings", "Exchanges" (topic matching: "*" one word, "#" zero
// or more), "Quorum Queues" (x-message-ttl and at-least-once
// dead-lettering, 3.10+), "Publishers" (mandatory) and "Consumer
// Acknowledgements and Publisher Confirms".
//
// # Imports
//
// What it may import: of this module amqpretry, router, confirm, amqpwire,
// middleware and internal/...; the machinery is in internal/cascadecore.
// Enforced by TestLayers in docs/.
package cascade
