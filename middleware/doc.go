// Package middleware holds the broker-agnostic retry middlewares for
// Watermill, each usable alone with any Pub/Sub: the AttemptCounter and its
// AttemptSource type (HeaderSource: the library's own count), the
// Classifier, the Republisher with the Delayer seam (MemoryDelayer for
// tests), the RedeliveryGuard, the Pause, Tracing and the Observer; and the
// one metadata vocabulary (metadata.go: every key the chain and the
// transports read or write, x-* included, and IsRetryState /
// IsDeliveryOnly). package router assembles them in their one correct order.
//
// # Imports
//
// What it may import: Watermill, backoff, gobreaker, OpenTelemetry and the
// standard library; nothing of this module and no AMQP client (amqp091-go,
// watermill-amqp). RabbitMQ specifics live in amqpwire (x-death, the broker's
// attempt sources) and amqpretry; only their metadata key names are here, in
// metadata.go. Enforced by TestLayers in docs/.
package middleware
