// Package deliverylog is the contract between the audit Consumer and the
// stores of this module that keep a delivery log (audit/pgstore: table
// unacked_arrivals; audit/audittest and audit/internal/memstore: in
// memory), which makes each publish exactly one arrival even when a
// Consumer process dies between the commit of a batch and its ack.
//
// RabbitMQ redelivers such a batch with the redelivered flag set
// ("Consumer Acknowledgements and Publisher Confirms": Redeliveries) to a
// Consumer that cannot know, from the delivery alone, whether it was
// stored. With a Log the Consumer records, in the transaction that stores
// an arrival, a Delivery row; marks it Acking before the ack
// (DeliveriesAcking); and deletes it with the next batch's mark, once the
// ack was sent. A redelivery whose fingerprint matches a row of a session
// that has ended, not Acking, claims that row and reuses its arrival ID,
// so the record is not stored twice; one matching only Acking rows of
// ended sessions is stored again, flagged Arrival.MaybeDuplicate (the ack
// may have been lost with the process), and deletes one of them
// (TakeAckingDelivery): a row whose ack was sent is never claimed, so a
// publish is never taken for another. A first delivery never claims a
// row, so identical publishes stay distinct arrivals. Without a Log the
// Consumer stores such a redelivery again, flagged Arrival.MaybeDuplicate.
//
// A Store offers its Log by embedding an Offer (Of finds it). Internal:
// it imports nothing of audit (audit imports it), so Log takes the record
// types as type parameters: Log[audit.Arrival, audit.Attempt].
package deliverylog

import "context"

// Delivery is a row of a Log: the arrival ArrivalID was stored from a
// delivery that Consumer session Session holds and has not acked yet
// (Acking false), or is acking (Acking true).
type Delivery struct {
	// ArrivalID is the stored arrival's ID (Arrival.ID).
	ArrivalID string
	// Fingerprint is a hex SHA-256 over the audit queue's name and the
	// delivery's content (exchange, routing key, message id, AMQP
	// timestamp, headers, body): equal for identical publishes.
	Fingerprint string
	// Session is the random token of the Consumer session holding the
	// delivery (one per AMQP connection of the Consumer).
	Session string
	// Acking is set (DeliveriesAcking) right before the session sends the
	// delivery's ack: if the session has ended, the ack may or may not have
	// reached RabbitMQ, so a redelivery of this content is stored again,
	// flagged Arrival.MaybeDuplicate, instead of claiming the row.
	Acking bool
}

// Log is a store's delivery log; A is audit.Arrival, T audit.Attempt.
type Log[A, T any] interface {
	// WriteDeliveries is the Store's Write, and records deliveries in the
	// same transaction, not Acking (a row already stored under the same
	// ArrivalID is replaced: it moves to the new session).
	WriteDeliveries(ctx context.Context, arrivals []A, attempts []T, deliveries []Delivery) error
	// UnackedDeliveries returns the rows of these fingerprints.
	UnackedDeliveries(ctx context.Context, fingerprints []string) ([]Delivery, error)
	// ClaimDelivery moves the row of arrivalID from session from to
	// session to, atomically, if it is not Acking: false if it is gone,
	// Acking, or held by another session (another Consumer claimed it
	// first).
	ClaimDelivery(ctx context.Context, arrivalID, from, to string) (bool, error)
	// TakeAckingDelivery deletes the row of arrivalID if session holds it
	// and it is Acking (a redelivery matched it and is stored again,
	// flagged): false if it is gone or changed (another Consumer took it,
	// or DeliveriesNotAcked cleared Acking: then it can be claimed).
	TakeAckingDelivery(ctx context.Context, arrivalID, session string) (bool, error)
	// DeliveriesAcking, in one atomic step, deletes session's rows that
	// are Acking (marked by an earlier call: their acks were sent), and
	// rows older than a day (their sessions' deliveries were redelivered
	// and claimed or stored long ago), then sets Acking on session's rows
	// of these arrival IDs. The Consumer calls it before each ack of
	// arrivals, and with no IDs when a session ends after its last ack.
	DeliveriesAcking(ctx context.Context, session string, arrivalIDs []string) error
	// DeliveriesNotAcked clears Acking on session's rows of these arrival
	// IDs: their ack could not be sent (the channel or connection closed
	// first), so their redeliveries may claim them.
	DeliveriesNotAcked(ctx context.Context, session string, arrivalIDs []string) error
}

// Offer, embedded in a Store, offers the Store's Log to the Consumer (Of).
// Embed it under an unexported alias name
// (type logOffer = deliverylog.Offer[audit.Arrival, audit.Attempt]), so the
// field stays out of the Store's API. A type that embeds such a Store
// offers its Log too.
type Offer[A, T any] struct{ log Log[A, T] }

// NewOffer returns an Offer of l (nil: none).
func NewOffer[A, T any](l Log[A, T]) Offer[A, T] { return Offer[A, T]{log: l} }

func (o Offer[A, T]) deliveryLog() Log[A, T] { return o.log }

// Of returns the Log that store offers through an embedded Offer, nil if
// it offers none.
func Of[A, T any](store any) Log[A, T] {
	if o, ok := store.(interface{ deliveryLog() Log[A, T] }); ok {
		return o.deliveryLog()
	}
	return nil
}
