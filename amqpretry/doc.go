// Package amqpretry is the RabbitMQ side of the retry library: the retry
// topology (loop-back exchange, one wait queue per delay tier, poison queue),
// a Marshaler that reads x-death and x-delivery-count instead of failing,
// republishing with publisher confirms and mandatory returns, and New, which
// wires it all into one Watermill middleware.
//
//	retry, err := amqpretry.New(amqpretry.Config{URI: uri, Subscriber: subCfg})
//	sub, err := retry.NewSubscriber(logger, 0)
//	router.AddMiddleware(retry.Middleware)
//
// # Imports
//
// What it may import: of this module middleware, amqpwire, confirm, router and
// internal/...; never audit, poison, metrics or the cascade (which builds on
// it). Enforced by TestLayers in docs/.
package amqpretry
