// Package confirm is the confirm publisher: it publishes with RabbitMQ
// publisher confirms and mandatory=true and reports per message whether the
// broker took responsibility for it (ack, nack, return, timeout, a closed
// channel), with flow control (connection.blocked), socket write deadlines,
// pipelined publishes and basic.return matched to its publish by
// PublishIDHeader. See Publisher and New.
//
// Its users in this module: amqpretry (the retry publisher), the delay
// cascade, audit (Recorder, Resender) and poison/admin (replay).
//
// Imports: the standard library, amqp091-go, watermill (its LoggerAdapter),
// backoff and internal/redact; of this module's public packages at most
// amqpwire. It never imports amqpretry, middleware, router, poison, audit or
// metrics (enforced by the layers test in docs/).
package confirm
