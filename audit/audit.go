package audit

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
)

// Outcome is how an attempt ended.
type Outcome string

// The outcomes of an attempt.
const (
	// OutcomeSuccess: the handler returned nil; the message was acked.
	OutcomeSuccess Outcome = "success"
	// OutcomeRetry: a retry copy was scheduled (held by the Delayer, or
	// handed to the broker's dead-lettering or native delayed retry); Delay
	// and Tier say when it comes back.
	OutcomeRetry Outcome = "retry"
	// OutcomePoisoned: confirmed into the poison queue; ErrorClass says why.
	OutcomePoisoned Outcome = "poisoned"
	// OutcomeDropped: acked and discarded on a Drop classification.
	OutcomeDropped Outcome = "dropped"
	// OutcomeNacked: no retry or poison copy could be held (the broker
	// refused or timed out); the message went back to its queue (fallback
	// copy or nack with requeue) and will be delivered again.
	OutcomeNacked Outcome = "nacked"
	// OutcomeRequeued: the handler did not run (a redelivered message the
	// RedeliveryGuard copied back to its queue).
	OutcomeRequeued Outcome = "requeued"
)

// Arrival records one message published to an audited business exchange,
// as the audit queue received it.
type Arrival struct {
	// ID is the record's idempotency key, one per publish: the Consumer
	// gives every first delivery of the arrivals queue a new ID (a hex
	// SHA-256 over the content hash arrivalFromDelivery computes and a
	// random nonce), so two identical publishes (the same bytes within one
	// second, or one UUID published twice) are two arrivals. A redelivery
	// of a stored arrival gets its ID back and is not stored again: with
	// pgstore.Store or audittest.MemoryStore (or a type embedding one),
	// which keep a delivery log, from the row its commit wrote, also after
	// the Consumer process died between commit and ack; with another Store
	// only from this Consumer process's memory (after a lost
	// connection), else it is stored under a new ID with MaybeDuplicate
	// set. Two publishes are never merged.
	ID string `json:"id"`
	// contentID is a hex SHA-256 over the exchange, routing key, message
	// id, AMQP timestamp, headers and body: equal for identical publishes
	// (arrivalFromDelivery sets it, and ID to it). Not stored.
	contentID string
	// MessageID is the Watermill message UUID (the UUID header, else the
	// AMQP message-id property); empty if the message had neither.
	MessageID string `json:"message_id"`
	// CorrelationID is the AMQP correlation-id property.
	CorrelationID string `json:"correlation_id,omitempty"`
	// Exchange and RoutingKey are where it was published.
	Exchange   string `json:"exchange"`
	RoutingKey string `json:"routing_key"`
	// PublishedAt is the AMQP timestamp property, zero if unset.
	PublishedAt time.Time `json:"published_at,omitzero"`
	// ArrivedAt is when the audit consumer received it.
	ArrivedAt time.Time `json:"arrived_at"`
	// Headers are the AMQP headers, as JSON values (tables as objects,
	// byte arrays base64, times RFC 3339): for search and display.
	Headers map[string]any `json:"headers,omitempty"`
	// HeaderTable are the same headers exactly as they arrived, each value
	// with its AMQP field type (int32, int64, decimal, timestamp, byte
	// array, ...), which the JSON form cannot keep; Resend publishes these.
	// Stored by pgstore (migration 0004) as wire.EncodeHeaderTable's
	// text; nil for arrivals recorded before, whose resend falls back to
	// the JSON form.
	HeaderTable amqp.Table `json:"-"`
	// Properties are the other AMQP properties that were set (content-type,
	// content-encoding, delivery-mode, priority, reply-to, expiration, type,
	// user-id, app-id), by their AMQP names.
	Properties map[string]string `json:"properties,omitempty"`
	// Body is the body, byte-exact, cut to the consumer's BodyLimit.
	Body []byte `json:"body"`
	// BodySize is the body's full size in bytes.
	BodySize int `json:"body_size"`
	// BodyTruncated is true when Body was cut (len(Body) < BodySize).
	BodyTruncated bool `json:"body_truncated,omitempty"`
	// MaybeDuplicate is true for an arrival recorded from a redelivery the
	// Consumer could not match to its first delivery: with a Store without
	// a delivery log (see ID), when that delivery went to a Consumer process that
	// died (or to another one); with a delivery log, when the state of a
	// session holding a matching row could not be read, or the matching rows
	// are of ended sessions that were acking their deliveries (the process
	// died between marking them and the ack, or right after it). If the first
	// delivery had been stored, this is a second record of the same publish
	// (same content: ArrivalVariants does not count it).
	MaybeDuplicate bool `json:"maybe_duplicate,omitempty"`
}

// Attempt records one attempt at a message by the retry chain.
type Attempt struct {
	// ID is the record's idempotency key, a random UUID made when the
	// attempt ended.
	ID string `json:"id"`
	// MessageID is the Watermill message UUID.
	MessageID string `json:"message_id"`
	// CorrelationID is the AMQP correlation-id property, if any.
	CorrelationID string `json:"correlation_id,omitempty"`
	// Queue is the originating queue the attempt consumed from.
	Queue string `json:"queue"`
	// Attempt is the attempt number, 1 on the first delivery.
	Attempt int `json:"attempt"`
	// StartedAt is when the attempt entered the chain.
	StartedAt time.Time `json:"started_at"`
	// Duration is how long the handler ran (zero if it did not run).
	Duration time.Duration `json:"duration_ns"`
	// Outcome is how the attempt ended.
	Outcome Outcome `json:"outcome"`
	// Delay is the retry delay of an OutcomeRetry, Tier the wait queue's
	// delay it went to (zero without tiers: the exact-delay cascade or
	// native retry).
	Delay time.Duration `json:"delay_ns,omitempty"`
	Tier  time.Duration `json:"tier_ns,omitempty"`
	// ErrorClass is the classifier's class ("transient", "permanent",
	// "malformed", "retry-after", "exhausted", ...), empty on success.
	ErrorClass string `json:"error_class,omitempty"`
	// Error is the handler's error, rendered by the chain's ErrorText
	// (redacted, cut to 1 KiB by default); for OutcomeNacked, also why no
	// copy could be held.
	Error string `json:"error,omitempty"`
	// RecordedBy is the RabbitMQ user that published the record: the
	// AMQP user-id property, which the broker validates against the
	// publishing connection's user ("Validated User-ID"). The Consumer sets
	// it from the delivery (never from the record's body) and stores only
	// records of its ConsumerConfig.RecorderUsers.
	RecordedBy string `json:"recorded_by,omitempty"`
}

// Message is one message's story as the store returns it: its arrival (nil
// if it arrived before auditing began, or not through an audited exchange)
// and its attempts, oldest first.
//
// A message id can have several arrivals (the same id published twice, or
// on two exchanges): Arrival is the first (oldest) one that matches the
// Filter's arrival conditions (Exchange, RoutingKey, Headers), else the
// first one; ArrivalCount says how many matched and ArrivalVariants how
// many of those differ in what a resend would publish (exchange, routing
// key, headers, properties, body). Resend refuses a message whose
// ArrivalVariants is above 1 (ambiguous: which one to send?).
type Message struct {
	MessageID string   `json:"message_id"`
	Arrival   *Arrival `json:"arrival,omitempty"`
	// ArrivalCount is the number of arrivals of the message matching the
	// filter (0 without an arrival).
	ArrivalCount int `json:"arrival_count,omitempty"`
	// ArrivalVariants is the number of distinct contents among them.
	ArrivalVariants int       `json:"arrival_variants,omitempty"`
	Attempts        []Attempt `json:"attempts"`
}

// Filter selects messages in Search and Resend. Zero fields do not filter;
// all set fields must match.
type Filter struct {
	// MessageID and CorrelationID match exactly.
	MessageID     string `json:"message_id,omitempty"`
	CorrelationID string `json:"correlation_id,omitempty"`
	// From and To bound the arrival time (or, without an arrival, the first
	// attempt's start): From <= t < To.
	From time.Time `json:"from,omitzero"`
	To   time.Time `json:"to,omitzero"`
	// Queue matches an attempt's queue; Exchange and RoutingKey the
	// arrival's.
	Queue      string `json:"queue,omitempty"`
	Exchange   string `json:"exchange,omitempty"`
	RoutingKey string `json:"routing_key,omitempty"`
	// Outcome and ErrorClass match any attempt's; LastOutcome the latest
	// attempt's.
	Outcome     Outcome `json:"outcome,omitempty"`
	LastOutcome Outcome `json:"last_outcome,omitempty"`
	ErrorClass  string  `json:"error_class,omitempty"`
	// ErrorContains matches attempts whose error text contains it
	// (case-insensitive).
	ErrorContains string `json:"error_contains,omitempty"`
	// Headers match arrivals whose headers contain every key with the given
	// JSON value (jsonb containment: {"tenant":"acme"}).
	Headers map[string]any `json:"headers,omitempty"`
	// Limit caps the number of messages returned (default 100, max 10,000);
	// After pages: messages whose (time, message id) sort after it.
	Limit int    `json:"limit,omitempty"`
	After string `json:"after,omitempty"`
}

// Store persists and finds records. Implemented by pgstore.Store (and, in
// memory, audittest.MemoryStore). An optional part a Store may have:
// SetAside (SetAsider). pgstore.Store and audittest.MemoryStore also keep a
// delivery log, which makes an arrival redelivered after a Consumer
// process died between commit and ack stored exactly once (see
// Arrival.ID); a type that embeds one of them keeps it, and then writes
// arrivals through it, not through its own Write.
type Store interface {
	// Write stores the records in one transaction. It is idempotent on
	// Arrival.ID and Attempt.ID: writing a record again changes nothing.
	// It returns only once the records are durable (committed).
	Write(ctx context.Context, arrivals []Arrival, attempts []Attempt) error
	// Search returns the messages matching f, newest first, each with its
	// arrival and attempts.
	Search(ctx context.Context, f Filter) ([]Message, error)
}

// ErrRecordRejected is wrapped by a Store.Write error that no retry can
// fix: the store can never take a record of the batch (pgstore: a value
// over its bounds, or PostgreSQL SQLSTATE class 22 "data exception" or 54
// "program limit exceeded", e.g. 54000 "index row size exceeds maximum").
// The Consumer then splits the batch until it finds the record and sets it
// aside (SetAsider); every other error is taken as temporary and retried.
var ErrRecordRejected = errors.New("audit: the store rejects a record for good")

// SetAside is a record the store rejected for good (ErrRecordRejected),
// kept with the reason instead of being stored.
type SetAside struct {
	// Kind is "arrival" or "attempt".
	Kind string `json:"kind"`
	// RecordID and MessageID are the record's (possibly very long: the
	// store may cut them).
	RecordID  string `json:"record_id"`
	MessageID string `json:"message_id"`
	// Reason is the store's error text.
	Reason string `json:"reason"`
	// Record is the record as JSON (an Arrival or Attempt).
	Record json.RawMessage `json:"record"`
}

// SetAsider is implemented by a Store that keeps the records it rejects
// (pgstore.Store: table set_aside; audittest.MemoryStore). SetAside must be
// idempotent and only fail temporarily (the Consumer retries it). With a
// Store that does not implement it, the Consumer retries a rejected record
// forever, stalling its queue.
type SetAsider interface {
	SetAside(ctx context.Context, records []SetAside) error
}

// unackedDelivery is a row of a Store's delivery log.
type unackedDelivery = deliverylog.Delivery

// deliveryLog is a Store's delivery log (see package
// audit/internal/deliverylog): pgstore.Store and audittest.MemoryStore
// offer one.
type deliveryLog = deliverylog.Log[Arrival, Attempt]

// deliveryLogOf returns s's delivery log, nil if it has none.
func deliveryLogOf(s Store) deliveryLog { return deliverylog.Of[Arrival, Attempt](s) }

// marshalAttempt encodes an Attempt as the Recorder publishes it on the
// audit exchange (JSON, content-type application/json).
func marshalAttempt(a Attempt) ([]byte, error) { return json.Marshal(a) }

// unmarshalAttempt decodes marshalAttempt's output.
func unmarshalAttempt(b []byte) (Attempt, error) {
	var a Attempt
	err := json.Unmarshal(b, &a)
	return a, err
}
