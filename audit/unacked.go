package audit

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
)

// With a Store that has a delivery log, the Consumer makes an arrival
// redelivered after a crash between commit and ack exact:
//
//   - Each AMQP session of the Consumer has a random token and holds an
//     exclusive queue named <ArrivalsQueue>.session.<token> (classic,
//     server-named no: the token is in the name). RabbitMQ deletes an
//     exclusive queue when its connection closes ("Queues": Exclusive
//     Queues), which is also when the connection's unacked deliveries are
//     requeued: a session whose queue is gone (queue.declare passive: 404)
//     holds no delivery any more; one whose queue exists (405
//     RESOURCE_LOCKED: exclusive to another connection) may.
//   - Every arrival is written with an unackedDelivery row (its ID, its
//     fingerprint, the token) in the same transaction. Before a batch's
//     ack, the acker marks its rows Acking and deletes the rows it marked
//     before (their acks were sent), in one statement (DeliveriesAcking);
//     a session that ends cleanly deletes its last marked rows. So no row
//     outlives a sent ack as a claimable row: a row whose delivery was
//     acked is never taken for another publish.
//   - A redelivered arrival (basic.deliver's redelivered flag) claims a row
//     of its fingerprint held by an ended session, not Acking
//     (ClaimDelivery, so of two Consumers only one gets a row) and takes
//     its arrival ID: it was stored, and is not stored again. An Acking row
//     of an ended session (the process died between the mark and the ack,
//     or after the ack) is never claimed: the redelivery takes it
//     (TakeAckingDelivery deletes it, so it is used once) and is stored
//     under a new ID flagged MaybeDuplicate. A row that changed under the
//     claim (claimed by another Consumer, or its Acking mark cleared by
//     DeliveriesNotAcked because the ack could not be sent) makes the rows
//     be read again.
//     No such row: its first delivery never committed, it is stored under
//     a new ID. Rows only of live
//     sessions (still live after sessionLiveRecheckWait, the lag allowed
//     between the requeue and the deletion of the exclusive queue): a live
//     session cannot hold the delivery that was redelivered, so those are
//     other publishes of the same content; it is stored under a new ID.
//     Rows of sessions whose state could not be read (an AMQP error other
//     than 404 and 405): stored under a new ID flagged MaybeDuplicate.

// sessionQueueInfix names a session's exclusive liveness queue.
const sessionQueueInfix = ".session."

// sessionLiveRechecks and sessionLiveRecheckWait bound the wait for a
// session that holds a matching row and still looks alive: its connection
// may have closed a moment ago (its deliveries requeued before its
// exclusive queue was deleted).
const (
	sessionLiveRechecks    = 1
	sessionLiveRecheckWait = time.Second
)

// maxRereads bounds how often the rows are read again at once after a row
// changed under a claim (another Consumer's claim, or an acking mark
// cleared); then the arrival is stored flagged MaybeDuplicate.
const maxRereads = 5

// sessionState is what queue.declare passive tells of a session's queue.
type sessionState int

const (
	sessionUnknown sessionState = iota // another error
	sessionAlive                       // 405 RESOURCE_LOCKED
	sessionEnded                       // 404 NOT_FOUND
)

func randomToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// fingerprint is an unackedDelivery's Fingerprint: the audit queue and the
// delivery's content.
func fingerprint(queue, contentID string) string {
	sum := sha256.Sum256([]byte(queue + "\x00" + contentID))
	return hex.EncodeToString(sum[:])
}

// newArrivalID is a fresh per-publish ID for content contentID.
func newArrivalID(contentID string) string {
	var nonce [16]byte
	_, _ = rand.Read(nonce[:])
	sum := sha256.Sum256(append([]byte(contentID), nonce[:]...))
	return hex.EncodeToString(sum[:])
}

func (c *Consumer) sessionQueue(token string) string {
	return c.cfg.Naming.ArrivalsQueue + sessionQueueInfix + token
}

// holdSession declares this session's exclusive liveness queue.
func (c *Consumer) holdSession(conn *amqp.Connection, token string) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	_, err = ch.QueueDeclare(c.sessionQueue(token), false, true, true, false, amqp.Table{"x-queue-type": queueTypeClassic})
	return err
}

// sessionState reads whether session token's connection is closed
// (ended sessions stay ended: cached).
func (c *Consumer) sessionState(conn *amqp.Connection, token string) sessionState {
	if _, ok := c.ended.Load(token); ok {
		return sessionEnded
	}
	ch, err := conn.Channel()
	if err != nil {
		return sessionUnknown
	}
	_, err = ch.QueueDeclarePassive(c.sessionQueue(token), false, true, true, false, nil)
	var ae *amqp.Error
	switch {
	case errors.As(err, &ae) && ae.Code == amqp.NotFound:
		c.ended.Store(token, struct{}{})
		return sessionEnded
	case errors.As(err, &ae) && ae.Code == amqp.ResourceLocked:
		return sessionAlive
	case err == nil: // not exclusive to another connection: not a session queue
		_ = ch.Close()
	}
	return sessionUnknown
}

// claimTally is what claimOne found among one arrival's candidate rows:
// rows of live sessions and of sessions whose state could not be read,
// and whether it claimed a row, took an acking row, or lost a row to a
// change (another Consumer, a cleared acking mark).
type claimTally struct {
	live, unknown          int
	claimed, took, changed bool
}

// claimOne tries arrival i's candidate rows (of other sessions) in order
// until it claims one (the arrival gets its ID) or takes an acking one;
// rest are the rows left for the next arrival with the same fingerprint.
func (c *Consumer) claimOne(ctx context.Context, conn *amqp.Connection, token string, b *batch, i int, cands []unackedDelivery) (rest []unackedDelivery, t claimTally, err error) {
	for k, cand := range cands {
		switch c.sessionState(conn, cand.Session) {
		case sessionAlive:
			t.live++
			rest = append(rest, cand)
			continue
		case sessionUnknown:
			t.unknown++
			rest = append(rest, cand)
			continue
		}
		var ok bool
		if cand.Acking { // its ack may have reached RabbitMQ: never claimed, taken
			ok, err = c.log.TakeAckingDelivery(ctx, cand.ArrivalID, cand.Session)
		} else {
			ok, err = c.log.ClaimDelivery(ctx, cand.ArrivalID, cand.Session, token)
		}
		if err != nil {
			return nil, t, err
		}
		if !ok {
			// Another Consumer took it, or an acking row was cleared
			// (its ack was not sent: claimable now): read again.
			t.changed = true
			continue
		}
		if cand.Acking {
			t.took = true
		} else {
			b.arrivals[i].ID, b.arrivals[i].MaybeDuplicate = cand.ArrivalID, false
			b.claimed[i], t.claimed = true, true
		}
		return append(rest, cands[k+1:]...), t, nil
	}
	return rest, t, nil
}

// claimRedelivered gives each redelivered arrival of b not yet resolved
// the ID of the stored arrival it redelivers (b.claimed), if a row of an
// ended session has it; see the comment at the top of this file.
//
// Cyclomatic complexity ~33, kept on purpose: the switch per arrival is
// the claim protocol's decision table (claimed, re-read, wait for a live
// session, flag maybe_duplicate, or first delivery) and reads against the
// cases listed at the top of this file.
func (c *Consumer) claimRedelivered(ctx context.Context, conn *amqp.Connection, token string, b *batch) error {
	var fps []string
	seen := map[string]bool{}
	for i, r := range b.redelivered {
		if r && !b.resolved[i] && !seen[b.fps[i]] {
			seen[b.fps[i]] = true
			fps = append(fps, b.fps[i])
		}
	}
	if len(fps) == 0 {
		return nil
	}
	for try, rereads := 0, 0; ; {
		rows, err := c.log.UnackedDeliveries(ctx, fps)
		if err != nil {
			return err
		}
		cands := map[string][]unackedDelivery{}
		for _, r := range rows {
			if r.Session != token {
				cands[r.Fingerprint] = append(cands[r.Fingerprint], r)
			}
		}
		waitLive, reread := false, false
		for i, r := range b.redelivered {
			if !r || b.resolved[i] {
				continue
			}
			fp := b.fps[i]
			rest, t, err := c.claimOne(ctx, conn, token, b, i, cands[fp])
			if err != nil {
				return err
			}
			live, unknown, claimed, took, changed := t.live, t.unknown, t.claimed, t.took, t.changed
			cands[fp] = rest
			switch {
			case claimed || live+unknown == 0 && !took && !changed: // claimed, or no row: the first delivery never committed
				b.resolved[i] = true
			case !took && changed && rereads < maxRereads:
				reread = true
			case !took && live+unknown > 0 && try < sessionLiveRechecks:
				waitLive = true
			case took || unknown > 0 || changed:
				b.resolved[i] = true
				b.arrivals[i].MaybeDuplicate = true
				c.cfg.Logger.Info("Redelivered arrival matches a row of an ended audit consumer session that was acking it, or rows of sessions whose state could not be read; stored flagged maybe_duplicate",
					watermill.LogFields{"message_id": b.arrivals[i].MessageID, "arrival_id": b.arrivals[i].ID, "acking_row_taken": took, "unknown_rows": unknown})
			default: // rows of live sessions only: other publishes of the same content
				b.resolved[i] = true
			}
		}
		if !waitLive && !reread {
			return nil
		}
		if reread {
			rereads++
		}
		if !waitLive {
			continue
		}
		try++
		t := time.NewTimer(sessionLiveRecheckWait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// ackingIDs are the arrival IDs whose rows the acker marks Acking before
// b's ack (nil without a delivery log or arrivals).
func (c *Consumer) ackingIDs(b batch) []string {
	if c.log == nil || b.arrTag == 0 || len(b.arrivals) == 0 {
		return nil
	}
	ids := make([]string, len(b.arrivals))
	for i := range b.arrivals {
		ids[i] = b.arrivals[i].ID
	}
	return ids
}

// markAcking runs DeliveriesAcking (one statement) until it succeeds,
// paced by WriteBackoff; an error only if ctx ends or the connection is
// lost meanwhile (then nothing is acked: the broker redelivers the batch,
// whose rows are not Acking and are claimed).
func (c *Consumer) markAcking(ctx context.Context, conn *amqp.Connection, token string, ids []string) error {
	var bo backoff.BackOff
	for {
		if conn.IsClosed() {
			return errors.New("audit: connection lost before the ack; the broker redelivers the batch")
		}
		err := c.log.DeliveriesAcking(ctx, token, ids)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if bo == nil {
			bo = c.cfg.WriteBackoff()
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			wait = 30 * time.Second
		}
		c.cfg.Logger.Error("Marking the unacked-delivery rows of a batch before its ack failed; the batch stays unacked, retrying", err,
			watermill.LogFields{"rows": len(ids), "retry_in": wait.String()})
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// storeCall runs f with a 5 s timeout, logging a failure (what).
func (c *Consumer) storeCall(what string, rows int, f func(context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := f(ctx); err != nil {
		c.cfg.Logger.Error(what+" failed", err, watermill.LogFields{"rows": rows})
	}
}
