package audit

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"
)

// With a Store that is a DeliveryLog, the Consumer makes an arrival
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
//   - Every arrival is written with an UnackedDelivery row (its ID, its
//     fingerprint, the token) in the same transaction; after the ack the
//     rows are deleted (sessionCleaner).
//   - A redelivered arrival (basic.deliver's redelivered flag) claims a row
//     of its fingerprint held by an ended session (ClaimDelivery, so of two
//     Consumers only one gets a row) and takes its arrival ID: it was
//     stored, and is not stored again. No such row: its first delivery
//     never committed, it is stored under a new ID. Rows only of live
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

// fingerprint is an UnackedDelivery's Fingerprint: the audit queue and the
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
	_, err = ch.QueueDeclare(c.sessionQueue(token), false, true, true, false, amqp.Table{"x-queue-type": QueueTypeClassic})
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

// claimRedelivered gives each redelivered arrival of b not yet resolved
// the ID of the stored arrival it redelivers (b.claimed), if a row of an
// ended session has it; see the comment at the top of this file.
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
	for try := 0; ; try++ {
		rows, err := c.log.UnackedDeliveries(ctx, fps)
		if err != nil {
			return err
		}
		cands := map[string][]UnackedDelivery{}
		for _, r := range rows {
			if r.Session != token {
				cands[r.Fingerprint] = append(cands[r.Fingerprint], r)
			}
		}
		waitLive := false
		for i, r := range b.redelivered {
			if !r || b.resolved[i] {
				continue
			}
			fp := b.fps[i]
			live, unknown := 0, 0
			var rest []UnackedDelivery
			for k, cand := range cands[fp] {
				switch c.sessionState(conn, cand.Session) {
				case sessionAlive:
					live++
					rest = append(rest, cand)
					continue
				case sessionUnknown:
					unknown++
					rest = append(rest, cand)
					continue
				}
				ok, err := c.log.ClaimDelivery(ctx, cand.ArrivalID, cand.Session, token)
				if err != nil {
					return err
				}
				if ok {
					b.arrivals[i].ID, b.arrivals[i].MaybeDuplicate = cand.ArrivalID, false
					b.resolved[i], b.claimed[i] = true, true
					rest = append(rest, cands[fp][k+1:]...)
					live, unknown = -1, -1
					break
				}
			}
			cands[fp] = rest
			switch {
			case live <= 0 && unknown <= 0: // claimed, or no row: the first delivery never committed
				b.resolved[i] = true
			case try < sessionLiveRechecks:
				waitLive = true
			case unknown > 0:
				b.resolved[i] = true
				b.arrivals[i].MaybeDuplicate = true
				c.cfg.Logger.Info("Redelivered arrival matches rows of audit consumer sessions whose state could not be read; stored flagged maybe_duplicate",
					watermill.LogFields{"message_id": b.arrivals[i].MessageID, "arrival_id": b.arrivals[i].ID})
			default: // rows of live sessions only: other publishes of the same content
				b.resolved[i] = true
			}
		}
		if !waitLive {
			return nil
		}
		t := time.NewTimer(sessionLiveRecheckWait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// sessionCleaner deletes the UnackedDelivery rows of acked arrivals, in
// the background (coalesced): acked adds IDs, stop makes a last attempt.
// A row left behind (the process died right after the ack) is pruned after
// a day; until then it can only be claimed by a redelivery of identical
// content whose first delivery never committed.
type sessionCleaner struct {
	c     *Consumer
	token string
	mu    sync.Mutex
	ids   []string
	kick  chan struct{}
	done  chan struct{}
	quit  chan struct{}
}

func (c *Consumer) startCleaner(token string) *sessionCleaner {
	s := &sessionCleaner{c: c, token: token, kick: make(chan struct{}, 1), done: make(chan struct{}), quit: make(chan struct{})}
	go s.run()
	return s
}

func (s *sessionCleaner) acked(arrivals []Arrival) {
	s.mu.Lock()
	for i := range arrivals {
		s.ids = append(s.ids, arrivals[i].ID)
	}
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

func (s *sessionCleaner) flush(timeout time.Duration) bool {
	s.mu.Lock()
	ids := s.ids
	s.ids = nil
	s.mu.Unlock()
	if len(ids) == 0 {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := s.c.log.DeliveriesAcked(ctx, s.token, ids); err != nil {
		s.c.cfg.Logger.Error("Deleting the unacked-delivery rows of acked arrivals failed; retrying", err, watermill.LogFields{"rows": len(ids)})
		s.mu.Lock()
		s.ids = append(ids, s.ids...)
		s.mu.Unlock()
		return false
	}
	return true
}

func (s *sessionCleaner) run() {
	defer close(s.done)
	retry := time.Second // doubles while the store fails, up to 30 s
	for {
		select {
		case <-s.quit:
			s.flush(5 * time.Second)
			return
		case <-s.kick:
			if s.flush(5 * time.Second) {
				retry = time.Second
			} else {
				t := time.NewTimer(retry)
				retry = min(2*retry, 30*time.Second)
				select {
				case <-s.quit:
					t.Stop()
					s.flush(5 * time.Second)
					return
				case <-t.C:
				}
				select {
				case s.kick <- struct{}{}:
				default:
				}
			}
		}
	}
}

func (s *sessionCleaner) stop() {
	close(s.quit)
	<-s.done
}
