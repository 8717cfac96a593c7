package audit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/confirm"
)

// run is the background publisher.
func (r *Recorder) run() {
	batch := make([]Attempt, 0, r.cfg.PublishBatch)
	for {
		batch = batch[:0]
		select {
		case a := <-r.records:
			batch = append(batch, a)
		case <-r.final:
			// No sender is left: publish what is buffered, then stop.
			for {
				batch = batch[:0]
				r.fill(&batch)
				if len(batch) == 0 {
					return
				}
				if !r.publish(batch) {
					return
				}
			}
		}
		r.fill(&batch)
		if !r.publish(batch) {
			return
		}
	}
}

// fill appends what is buffered, up to PublishBatch, without waiting.
func (r *Recorder) fill(batch *[]Attempt) {
	for len(*batch) < r.cfg.PublishBatch {
		select {
		case a := <-r.records:
			*batch = append(*batch, a)
		default:
			return
		}
	}
}

// publish publishes batch until the broker confirmed all of it; false if
// Close gave up first.
func (r *Recorder) publish(batch []Attempt) bool {
	r.inFlight.Add(int64(len(batch)))
	msgs := make([]amqp.Publishing, 0, len(batch))
	now := time.Now()
	for i := range batch {
		if batch[i].ID == "" {
			batch[i].ID = watermill.NewUUID()
		}
		body, err := marshalAttempt(batch[i])
		if err != nil { // cannot happen for these field types; never drop silently
			r.cfg.Logger.Error("Marshalling attempt record failed", err, watermill.LogFields{"message_uuid": batch[i].MessageID})
			continue
		}
		msgs = append(msgs, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: batch[i].ID, UserId: r.cfg.UserID,
			Timestamp: now, Type: "rabbitretry.audit.attempt", Body: body,
		})
	}
	var bo backoff.BackOff
	for {
		err := r.send(r.abortCtx, msgs)
		if err == nil {
			r.published.Add(uint64(len(msgs)))
			r.inFlight.Add(-int64(len(batch)))
			if bo != nil {
				r.cfg.Logger.Info("Audit records published again", watermill.LogFields{"records": len(msgs)})
			}
			return true
		}
		r.failures.Add(1)
		if r.abortCtx.Err() != nil {
			return false
		}
		if bo == nil {
			bo = r.cfg.RetryBackoff()
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			wait = 10 * time.Second
		}
		r.cfg.Logger.Error("Publishing audit records failed; retrying (records held in memory)", err, watermill.LogFields{
			"records": len(msgs), "retry_in": wait.String(),
		})
		if r.pub != nil && (errors.Is(err, confirm.ErrUnroutable) || errors.Is(err, confirm.ErrChannelClosed)) {
			// The audit queue or exchange may have been deleted: declare again.
			if derr := r.declare(); derr != nil {
				r.cfg.Logger.Error("Declaring the audit topology again failed", derr, nil)
			}
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-r.abortCtx.Done():
			t.Stop()
			return false
		}
	}
}

// Close stops recording (records made later are counted in
// Stats.Rejected and logged, not published), publishes everything buffered
// and waits for the broker's confirms. Close the router first, so no
// handler is still running. If ctx ends first, it stops publishing and
// returns ctx's error with the number of records left unpublished (lost).
// It then closes the Recorder's own publisher (not a Config.Publisher).
// Later calls return the first call's result.
func (r *Recorder) Close(ctx context.Context) error {
	r.closeOnce.Do(func() {
		close(r.closing)
		r.mu.Lock()
		r.closed = true
		r.mu.Unlock()
		close(r.final)
		select {
		case <-r.flushed:
		case <-ctx.Done():
			r.abort()
			<-r.flushed
			left := len(r.records) + int(r.inFlight.Load())
			r.closeErr = fmt.Errorf("audit: Recorder.Close: %d attempt records not published: %w", left, ctx.Err())
		}
		r.abort()
		if r.ownPub {
			if err := r.pub.Close(); err != nil && r.closeErr == nil {
				r.closeErr = err
			}
		}
	})
	return r.closeErr
}
