// Package middleware holds the retry chain's broker-agnostic Watermill
// middlewares, one file each, each with its Config (defaults filled in,
// Validate naming the bad field) and constructor:
//
//	classifier.go      Classifier: retry, poison, drop or nack for each handler error
//	                   (Permanent, Drop, RetryAfter, DependencyUnavailable mark errors)
//	attempt.go         AttemptCounter: the attempt number of each delivery, from AttemptSources
//	republisher.go     Republisher: schedules retries through a Delayer with backoff;
//	                   past MaxAttempts, an exhausted error (poisoned)
//	redelivery.go      RedeliveryGuard: redelivered messages, the remaining delay, quarantine
//	poison.go          PoisonForwarder: publishes poisoned messages (confirmed), then acks
//	pause.go           Pause: holds messages, uncharged, while a dependency is down
//	tracing.go         Tracing: one OpenTelemetry span per attempt
//
// and their seams: delayer.go (the Delayer interface; memory_delayer.go, an
// in-process Delayer for gochannel and tests), observers.go (Observer,
// told what the chain did with each failed message; the errors the middlewares
// return to one another are in internal/chainerr), backoff.go, and metadata.go, the vocabulary of
// metadata keys the library writes and reads.
//
// Most users never assemble these by hand: package router puts them in the
// one correct order (router.New), and amqpretry.New does so for RabbitMQ.
// The order and what each layer does are in docs/chain.md.
//
// # Imports
//
// What it may import: Watermill, backoff, gobreaker, OpenTelemetry, the
// standard library, and of this module only internal/retrymeta (the one
// vocabulary: every key defined once, with the strip predicates every copy
// path uses); no AMQP client (amqp091-go, watermill-amqp). RabbitMQ
// specifics live in amqpwire (x-death, the broker's attempt sources) and
// amqpretry; only their metadata key names are here. Enforced by TestLayers
// in docs/.
package middleware
