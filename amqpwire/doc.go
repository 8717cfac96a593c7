// Package amqpwire holds the AMQP 0-9-1 wire details the retry chain needs
// over RabbitMQ: the x-death header (DeathRecord, ParseXDeath, EncodeXDeath,
// DeathRecordsFromTable), the broker's count headers (Count), the field-table
// codec that keeps each header's exact AMQP type (EncodeHeaderTable,
// DecodeHeaderTable), headers as JSON (HeadersToJSON), the
// message properties carried in metadata (PropertiesToMetadata; their keys,
// like every metadata key, are in middleware/metadata.go), the frame
// size of a copy's headers (MaxCopyHeaderBytes, FitHeaders), and the attempt
// sources that read the broker's counts (XDeathSource, NackCountSource,
// AcquiredCountSource, DeliveryCountSource; Sources gives the set
// amqpretry.New uses).
//
// # Imports
//
// What it may import: amqp091-go, watermill-amqp, Watermill and, of this
// module, only middleware (the metadata vocabulary and the AttemptSource
// type). Enforced by TestLayers in docs/.
package amqpwire
