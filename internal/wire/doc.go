// Package wire holds the AMQP 0-9-1 wire details the library's RabbitMQ code
// (amqpretry, the delay cascade, the audit, poison/admin) shares: the x-death
// header (DeathRecord, ParseXDeath, EncodeXDeath, DeathRecordsFromTable), the
// broker's count headers (Count), the field-table codec that keeps each
// header's exact AMQP type (EncodeHeaderTable, DecodeHeaderTable), headers as
// JSON (HeadersToJSON), the message properties carried in metadata
// (PropertiesToMetadata, MetadataToProperties; their keys are in
// internal/retrymeta), and the frame size of a copy's headers
// (MaxCopyHeaderBytes, HeaderBytes, FitHeaders). Package amqpwire re-exports
// the few of them users read (DeathRecord, ParseXDeath, MaxCopyHeaderBytes).
package wire
