// Package audit records every business message's story, its arrival on a
// business exchange and each attempt the retry chain made at it, into a
// store (PostgreSQL: package audit/pgstore) where operators can find it and
// resend it.
//
// Two kinds of record, tied together by the message id (the Watermill
// message UUID, which every retry and poison copy keeps):
//
//   - Arrival: one per message published to an audited business exchange.
//     An audit queue bound to those exchanges receives one copy of each
//     publish; retry copies come back through the loop-back exchange, which
//     is not bound to it, so they are not recorded again (Consumer).
//   - Attempt: one per attempt the retry chain made (or decided without
//     running the handler): its number, queue, start time, duration,
//     outcome, delay and tier of a scheduled retry, error class and
//     (redacted) error text (Recorder).
//
// Never in the way, never lossy: the Recorder hands attempt records to a
// background publisher (confirmed publishes to the audit exchange), so a
// handler never waits on PostgreSQL; the Consumer writes batches to the
// Store and acks them only after the transaction commits, so while
// PostgreSQL is down records wait durably in RabbitMQ's audit queues, and
// a batch that is redelivered is written again without duplicates (Store
// writes are idempotent on the record IDs, and an arrival redelivered after
// the Consumer process died between commit and ack is found stored through
// the Store's delivery log; see Arrival.ID for a Store without one).
//
// # Imports
//
// What it may import: of this module middleware, amqpwire, confirm and
// internal/...; never amqpretry, router or poison. Enforced by TestLayers in
// docs/.
package audit
