package pgstore

import (
	"context"
	"fmt"
	"sort"

	"github.com/jackc/pgx/v5"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
)

// deliveryLog is the Store's delivery log (deliverylog.Log): the same pool
// and schema, table unacked_arrivals (migration 0005). The Store offers it
// to the audit.Consumer (logOffer), which records there each stored
// arrival's delivery until its ack, so that an arrival redelivered after
// the Consumer process died between commit and ack is stored exactly once.
type deliveryLog Store

// logOffer offers the Store's deliveryLog to the audit.Consumer; embedded
// under this unexported name, it adds nothing to the Store's API.
type logOffer = deliverylog.Offer[audit.Arrival, audit.Attempt]

var _ deliverylog.Log[audit.Arrival, audit.Attempt] = (*deliveryLog)(nil)

// unackedRetention is how long a row of unacked_arrivals (migration 0005)
// is kept at most: a row whose Consumer died for good and whose delivery
// was never redelivered (the audit queue deleted, or purged) is deleted by
// DeliveriesAcking after a day.
const unackedRetention = "1 day"

type unackedQueries struct {
	upsert, byFingerprint, claim, take, acking, notAcked string
}

func (q queries) unackedSQL() unackedQueries {
	t := q.unacked
	return unackedQueries{
		upsert: `INSERT INTO ` + t + ` AS u (arrival_id, fingerprint, session)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[])
ON CONFLICT (arrival_id) DO UPDATE SET session = EXCLUDED.session, fingerprint = EXCLUDED.fingerprint, since = now(), acking = false`,
		byFingerprint: `SELECT arrival_id, fingerprint, session, acking FROM ` + t + ` WHERE fingerprint = ANY($1) ORDER BY since, arrival_id`,
		claim:         `UPDATE ` + t + ` SET session = $3, since = now() WHERE arrival_id = $1 AND session = $2 AND NOT acking`,
		take:          `DELETE FROM ` + t + ` WHERE arrival_id = $1 AND session = $2 AND acking`,
		// One statement: the DELETE and the UPDATE see the same snapshot,
		// so the DELETE takes the rows marked by earlier calls only.
		acking: `WITH acked AS (DELETE FROM ` + t + ` WHERE (session = $1 AND acking) OR since < now() - interval '` + unackedRetention + `')
UPDATE ` + t + ` SET acking = true WHERE session = $1 AND arrival_id = ANY($2)`,
		notAcked: `UPDATE ` + t + ` SET acking = false WHERE session = $1 AND arrival_id = ANY($2)`,
	}
}

// WriteDeliveries is Store.Write, plus the rows of deliveries in table
// unacked_arrivals (not acking), in the same transaction
// (deliverylog.Log).
func (s *deliveryLog) WriteDeliveries(ctx context.Context, arrivals []audit.Arrival, attempts []audit.Attempt, deliveries []deliverylog.Delivery) error {
	if len(arrivals) == 0 && len(attempts) == 0 && len(deliveries) == 0 {
		return nil
	}
	b := &pgx.Batch{}
	if len(arrivals) > 0 || len(attempts) > 0 {
		var err error
		if b, err = buildWriteBatch(s.q, arrivals, attempts); err != nil {
			return err
		}
	}
	if len(deliveries) > 0 {
		d := append([]deliverylog.Delivery(nil), deliveries...)
		sort.Slice(d, func(i, j int) bool { return d[i].ArrivalID < d[j].ArrivalID }) // lock order
		ids, fps, sess := make([]string, 0, len(d)), make([]string, 0, len(d)), make([]string, 0, len(d))
		for i, x := range d {
			if i > 0 && x.ArrivalID == d[i-1].ArrivalID {
				continue // ON CONFLICT cannot update one row twice
			}
			ids, fps, sess = append(ids, cleanText(x.ArrivalID)), append(fps, cleanText(x.Fingerprint)), append(sess, cleanText(x.Session))
		}
		b.Queue(s.q.unackedSQL().upsert, ids, fps, sess)
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return fmt.Errorf("pgstore: write %d arrivals, %d attempts, %d unacked deliveries: %w", len(arrivals), len(attempts), len(deliveries), err)
	}
	return nil
}

// UnackedDeliveries returns the unacked_arrivals rows of these
// fingerprints, oldest first (deliverylog.Log).
func (s *deliveryLog) UnackedDeliveries(ctx context.Context, fingerprints []string) ([]deliverylog.Delivery, error) {
	rows, err := s.pool.Query(ctx, s.q.unackedSQL().byFingerprint, fingerprints)
	if err != nil {
		return nil, fmt.Errorf("pgstore: unacked deliveries: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (deliverylog.Delivery, error) {
		var d deliverylog.Delivery
		err := r.Scan(&d.ArrivalID, &d.Fingerprint, &d.Session, &d.Acking)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("pgstore: unacked deliveries: %w", err)
	}
	return out, nil
}

// ClaimDelivery moves the row of arrivalID from session from to session
// to, unless it is acking; false if no such row (deliverylog.Log). One
// UPDATE: of two Consumers claiming one row, one wins.
func (s *deliveryLog) ClaimDelivery(ctx context.Context, arrivalID, from, to string) (bool, error) {
	tag, err := s.pool.Exec(ctx, s.q.unackedSQL().claim, arrivalID, from, to)
	if err != nil {
		return false, fmt.Errorf("pgstore: claim unacked delivery: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// TakeAckingDelivery deletes the row of arrivalID if session holds it and
// it is acking; false if not (deliverylog.Log). One DELETE: of two
// Consumers, one wins.
func (s *deliveryLog) TakeAckingDelivery(ctx context.Context, arrivalID, session string) (bool, error) {
	tag, err := s.pool.Exec(ctx, s.q.unackedSQL().take, arrivalID, session)
	if err != nil {
		return false, fmt.Errorf("pgstore: take acking unacked delivery: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// DeliveriesAcking deletes session's acking unacked_arrivals rows and
// every row older than unackedRetention, and marks session's rows of
// these arrival IDs acking, in one statement (deliverylog.Log).
func (s *deliveryLog) DeliveriesAcking(ctx context.Context, session string, arrivalIDs []string) error {
	if _, err := s.pool.Exec(ctx, s.q.unackedSQL().acking, session, arrivalIDs); err != nil {
		return fmt.Errorf("pgstore: mark deliveries acking: %w", err)
	}
	return nil
}

// DeliveriesNotAcked clears acking on session's rows of these arrival IDs
// (deliverylog.Log).
func (s *deliveryLog) DeliveriesNotAcked(ctx context.Context, session string, arrivalIDs []string) error {
	if _, err := s.pool.Exec(ctx, s.q.unackedSQL().notAcked, session, arrivalIDs); err != nil {
		return fmt.Errorf("pgstore: unmark deliveries acking: %w", err)
	}
	return nil
}
