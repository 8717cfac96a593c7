// Package metrics exports Prometheus metrics for the retry chain: handler
// attempts, scheduled and failed retries, poisoned and dropped messages.
//
// A *Metrics gives two things: a middleware.Observer (Metrics.Observer),
// told by the republisher, the poison forwarder and the classifier what they
// did with each failed message, and a Watermill middleware
// (Metrics.Middleware) that counts every handler attempt. Wire both:
//
//	reg := prometheus.NewRegistry() // or leave Registerer nil for prometheus.DefaultRegisterer
//	m, err := metrics.New(metrics.Config{Registerer: reg})
//	if err != nil { ... }
//	chain, err := router.New(router.Config{..., Policy: router.Policy{Observer: m.Observer()}})
//	if err != nil { ... }
//	r.AddMiddleware(chain.Middleware, m.Middleware)
//	// or: chain.AddTo(r, m.Middleware, wmw.Recoverer)
//
// Watermill runs the first middleware added outermost, so m.Middleware must
// come after chain.Middleware: it then runs inside the chain's attempt
// counter (the attempt number is known) and sees the handler's own result,
// before the republisher turns a failure into a scheduled retry. Put
// Recoverer inside m.Middleware (after it) so that panics count as errors.
//
// # Metrics
//
// All names start with Config.Namespace (default "rabbitretry") and an
// underscore. Durations are in seconds.
//
//	Name                      Type       Labels        Meaning
//	attempts_total            counter    queue,outcome handler attempts; outcome is "success" or "error"
//	attempt_number            histogram  queue         attempt number (1 = first delivery) of each handled attempt; buckets 1,2,3,5,8,13,21
//	retries_scheduled_total   counter    queue,tier    retry copies confirmed by the Delayer (the original was acked)
//	retry_delay_seconds       histogram  queue         delay requested for each scheduled retry, in seconds
//	republish_seconds         histogram  queue         time the Delayer needed to hold a retry copy (publish + confirm on AMQP), in seconds
//	retry_failures_total      counter    queue         retries the Delayer could not hold; the message was nacked
//	poisoned_total            counter    queue,class   messages confirmed into the poison queue
//	poison_failures_total     counter    queue         poison publishes that failed; the message was nacked
//	dropped_total             counter    queue         messages acked and discarded on middleware.ActionDrop
//	broker_route_in_place     gauge      queue,route   1 if the last check found the broker-side retry route in place, 0 if retries take the publish path
//	broker_route_problems_total counter  queue,route   checks that found it not in place (a policy changed, the first wait queue missing or length-limited)
//
// # Labels and cardinality
//
// Every label has a bounded set of values, as long as the configuration
// keeps it so:
//
//   - queue: Config.QueueName of the message's context (default: the
//     router's subscribe topic), else the message's
//     "rabbitretry-original-queue" metadata, else "unknown". One value per
//     consumed queue.
//   - outcome: "success" or "error".
//   - route: the broker-side retry route of amqpretry ("dead-letter-first",
//     "native-delayed-retry"; see middleware.RouteObserver).
//   - tier: Config.Tier of the requested delay, rendered compactly ("250ms",
//     "1s", "5m", "2h"). The default Tier only rounds the delay to a
//     millisecond: with a constant backoff that is one value per delay, but
//     with a jittered backoff (retrymeta.DefaultBackoff) nearly every retry
//     gets its own value. With amqpretry set Tier to the topology's TierFor,
//     which maps each delay to one of its fixed wait-queue tiers.
//   - class: the error class of the poisoned message: "exhausted" for
//     retries that ran out of attempts, else the class of the classifier
//     rule that matched ("permanent", "malformed", ... and the Class of your
//     own middleware.Rule values, or ClassifierConfig.DefaultClass). Classes
//     come from configuration, never from error text; keep rule classes a
//     small fixed set.
//
// # Dropped messages
//
// dropped_total counts Observer.Dropped calls, which the Classifier makes
// when it acks and discards a message on middleware.ActionDrop (router.New
// hands router.Config.Observer to the Classifier too). The dropped handler
// attempt itself is also counted in attempts_total{outcome="error"}.
//
// # Imports
//
// What it may import: Prometheus, Watermill and, of this module, middleware
// (the Observer) and audit (its Consumer's metrics). Enforced by TestLayers in
// docs/.
package metrics
