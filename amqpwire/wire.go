package amqpwire

import "github.com/rabbitretry/rabbitretry/internal/wire"

// DeathRecord is one entry of RabbitMQ's x-death header ("Dead Letter
// Exchanges"): the broker appends or updates one entry per {queue, reason}
// each time a message is dead-lettered (reason "rejected", "expired",
// "maxlen" or "delivery_limit"); the most recent entry comes first. The
// amqpretry Marshaler gives a handler the header as a JSON array of
// DeathRecord under middleware.XDeathKey; read it with ParseXDeath.
type DeathRecord = wire.DeathRecord

// ParseXDeath decodes the JSON the amqpretry Marshaler writes under
// middleware.XDeathKey. An empty string yields no records and no error. It
// returns an error for malformed JSON or for more than 256 entries (RabbitMQ
// itself keeps one per {queue, reason}); it does not validate counts.
func ParseXDeath(s string) ([]DeathRecord, error) { return wire.ParseXDeath(s) }

// MaxCopyHeaderBytes is the largest encoded size, in bytes, of the headers of
// a retry or poison copy: RabbitMQ's default frame_max (128 KiB) minus 8 KiB
// kept for the other properties and the x-death header the broker adds when
// it dead-letters the copy (all headers travel in one content-header frame).
// A retry copy above it is refused by amqpretry's Delayer
// (middleware.ErrCannotDelay: the message is poisoned instead); a poison copy
// above it loses its largest user headers until it fits, their names listed
// under the poison copy's rabbitretry-dropped-headers header.
const MaxCopyHeaderBytes = wire.MaxCopyHeaderBytes
