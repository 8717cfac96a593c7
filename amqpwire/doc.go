// Package amqpwire holds what a user of the retry chain over RabbitMQ may
// need of the AMQP 0-9-1 wire: the attempt sources that read the broker's
// counts (XDeathSource, NackCountSource, AcquiredCountSource,
// DeliveryCountSource; Sources gives the set amqpretry.New uses), the x-death
// header as records (DeathRecord, ParseXDeath, from middleware.XDeathKey),
// and the size limit of a copy's headers (MaxCopyHeaderBytes). The wire
// codecs themselves (the field-table codec keeping each header's exact AMQP
// type, headers as JSON, the message properties carried in metadata, the
// frame size, the broker's count headers) are the library's own, in
// internal/wire.
//
// # Imports
//
// What it may import: amqp091-go, watermill-amqp, Watermill and, of this
// module, only middleware (the metadata vocabulary and the AttemptSource
// type), internal/retrymeta and internal/wire. Enforced by TestLayers in
// docs/.
package amqpwire
