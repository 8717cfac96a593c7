package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/poison"
)

// ReplayOptions configures Replay.
type ReplayOptions struct {
	// DryRun reports what Replay would do without publishing or removing
	// anything (the queue is still read, see List).
	DryRun bool
	// DefaultQueue is the queue to replay messages to that carry no
	// rabbitretry-original-queue header. Empty: such messages are skipped
	// (left in the poison queue) and reported with ErrNoOriginalQueue.
	DefaultQueue string
	// Progress, if set, is called after each matching message was handled
	// (replayed, failed or skipped), with done counting handled messages
	// and total = ReplayResult.Matched. It runs on Replay's goroutine and
	// may cancel Replay's ctx to stop it cleanly. Not called in DryRun.
	Progress func(done, total int)
}

// ReplayResult reports what Replay did (or, in DryRun, would do).
type ReplayResult struct {
	// Matched is the number of messages the filter selected (at most
	// Filter.Limit).
	Matched int `json:"matched"`
	// Replayed is the number of messages published to the loop-back
	// exchange, confirmed by the broker and removed from the poison queue;
	// in DryRun, the number that would be (those with a destination).
	Replayed int `json:"replayed"`
	// Skipped is the number of messages left in the poison queue because
	// they have no destination (see ReplayOptions.DefaultQueue).
	Skipped int `json:"skipped"`
	// Errors has one *MessageError per skipped or failed message. Failed
	// messages stay in the poison queue.
	Errors []error `json:"-"`
	// Duplicated lists the UUIDs of messages that may now be both in their
	// original queue and in the poison queue: republished (confirmed) but
	// their removal from the poison queue may not have taken effect because
	// the channel closed, or written but unconfirmed (confirm timeout,
	// channel closed while waiting). Never a loss.
	Duplicated []string `json:"duplicated,omitempty"`
}

// Keys Replay removes from the copy it publishes: the poison-only keys
// (so the message no longer looks poisoned), the attempt number (so the
// next delivery is attempt 1), stale per-retry keys, and broker-owned
// headers that would make the retry middleware count earlier attempts.
// The failure history (first/last failure, last error, error class,
// original queue/exchange/routing key) is kept.
var replayStripKeys = []string{
	poison.ReasonKey, poison.TopicKey, poison.HandlerKey, poison.SubscriberKey,
	poison.AttemptsKey, poison.PoisonedAtKey,
	middleware.AttemptKey, middleware.DelayKey, middleware.HeaderErrorKey,
	middleware.DeliveryExchangeKey, middleware.DeliveryRoutingKeyKey,
	middleware.XDeathKey, middleware.XDeliveryCountKey,
	"x-first-death-queue", "x-first-death-reason", "x-first-death-exchange",
	"x-last-death-queue", "x-last-death-reason", "x-last-death-exchange",
	amqpretry.PublishIDHeader,
}

// copyPublishing builds a publishing from a delivery with every property,
// except user-id: RabbitMQ rejects a publish whose user-id differs from the
// connection's user ("Validated User-ID"), and closes the channel.
func copyPublishing(d amqp.Delivery, headers amqp.Table) amqp.Publishing {
	return amqp.Publishing{
		Headers:         headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      d.Expiration,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

func cloneHeaders(h amqp.Table) amqp.Table {
	out := make(amqp.Table, len(h)+1)
	for k, v := range h {
		out[k] = v
	}
	return out
}

// replayPublishing is the copy Replay publishes: headers minus
// replayStripKeys, plus rabbitretry-replayed = now (RFC 3339, UTC).
func replayPublishing(d amqp.Delivery, now time.Time) amqp.Publishing {
	h := cloneHeaders(d.Headers)
	for _, k := range replayStripKeys {
		delete(h, k)
	}
	h[middleware.ReplayedKey] = now.UTC().Format(time.RFC3339)
	return copyPublishing(d, h)
}

// perMessage reports publish errors caused by the message or its
// destination; any other error (channel or connection closed, confirm
// timeout, publisher closed) stops the operation.
func perMessage(err error) bool {
	return errors.Is(err, amqpretry.ErrUnroutable) || errors.Is(err, amqpretry.ErrNacked)
}

// Replay sends the messages of the poison queue that f matches back to the
// queue they came from, for another round of attempts.
//
// Each matching message is published, as a copy, to Config.LoopBackExchange
// with routing key = its rabbitretry-original-queue header (or
// opts.DefaultQueue), with mandatory=true, and is acked in the poison queue
// only after the broker confirmed the copy ("Consumer Acknowledgements and
// Publisher Confirms", "Publishers"): a message is never lost, at worst it
// is duplicated (see ReplayResult.Duplicated). The copy keeps the body,
// properties (except user-id), UUID and failure history, gets
// rabbitretry-replayed = the replay time (RFC 3339), and loses the
// poison-only keys (reason_poisoned, topic_poisoned, handler_poisoned,
// subscriber_poisoned, rabbitretry-attempts, rabbitretry-poisoned-at), the
// attempt number rabbitretry-attempt (so the next delivery is attempt 1)
// and broker headers such as x-death. Non-matching messages stay in the
// poison queue, as redeliveries.
//
// The matching messages are collected first, reading at most the queue
// depth at the start, so Replay terminates even though requeued messages
// are immediately available again; then they are replayed one by one.
//
// A message without destination is skipped (ErrNoOriginalQueue); one the
// broker returns as unroutable (its queue is not bound to the loop-back
// exchange: amqpretry.ErrUnroutable) or nacks (amqpretry.ErrNacked) is left
// in place; both are reported in ReplayResult.Errors and Replay continues.
// Other failures stop Replay and are returned with the partial result.
// Canceling ctx stops Replay before the next message (a publish in progress
// still waits for its confirm, at most 30s, so it is not duplicated) and
// returns ctx.Err() wrapped with the partial result; everything not
// replayed stays in the poison queue.
//
// Errors: a *NotFoundError matching ErrQueueNotFound (queue missing) or
// ErrExchangeNotFound (loop-back exchange missing; nothing is changed); a
// Filter.Validate error; ErrClosed; ctx.Err(); channel, connection or
// confirm errors (amqpretry.ErrChannelClosed, amqpretry.ErrConfirmTimeout).
func (a *Admin) Replay(ctx context.Context, queue string, f Filter, opts ReplayOptions) (ReplayResult, error) {
	var res ReplayResult
	if ctx == nil {
		ctx = context.Background()
	}
	if opts.DefaultQueue != "" {
		if err := checkName("ReplayOptions.DefaultQueue", opts.DefaultQueue); err != nil {
			return res, err
		}
	}
	if err := checkName("queue", queue); err != nil {
		return res, err
	}
	if err := a.checkExchange(a.cfg.LoopBackExchange); err != nil {
		return res, err
	}
	s, err := a.scanQueue(ctx, queue, f, nil)
	if err != nil {
		return res, err
	}
	res.Matched = len(s.matched)

	dest := func(m Message) string {
		if m.OriginalQueue != "" {
			return m.OriginalQueue
		}
		return opts.DefaultQueue
	}
	if opts.DryRun {
		for _, it := range s.matched {
			if dest(it.msg) == "" {
				res.Skipped++
				res.Errors = append(res.Errors, &MessageError{UUID: it.msg.UUID, Err: ErrNoOriginalQueue})
			} else {
				res.Replayed++
			}
		}
		_ = a.finish(s, 0)
		return res, nil
	}

	var (
		opErr   error
		done    int
		acked   []string // UUIDs acked since the channel opened
		pubCtx  = context.WithoutCancel(ctx)
		total   = res.Matched
		handled = func() {
			done++
			if opts.Progress != nil {
				opts.Progress(done, total)
			}
		}
	)
loop:
	for _, it := range s.matched {
		if err := ctx.Err(); err != nil {
			opErr = fmt.Errorf("poison/admin: replay from %q interrupted after %d of %d messages: %w", queue, done, total, err)
			break
		}
		to := dest(it.msg)
		if to == "" {
			res.Skipped++
			res.Errors = append(res.Errors, &MessageError{UUID: it.msg.UUID, Err: ErrNoOriginalQueue})
			handled()
			continue
		}
		err := a.pub.PublishRaw(pubCtx, a.cfg.LoopBackExchange, to, replayPublishing(it.d, time.Now()))
		switch {
		case err == nil:
		case perMessage(err):
			res.Errors = append(res.Errors, &MessageError{UUID: it.msg.UUID, Queue: to, Err: err})
			a.logger.Error("Replay of a poisoned message failed; it stays in the poison queue", err, watermill.LogFields{
				"queue": queue, "message_uuid": it.msg.UUID, "to_queue": to,
			})
			handled()
			continue
		default:
			res.Errors = append(res.Errors, &MessageError{UUID: it.msg.UUID, Queue: to, Err: err})
			if errors.Is(err, amqpretry.ErrConfirmTimeout) || errors.Is(err, amqpretry.ErrChannelClosed) {
				// Written but unconfirmed: the copy may have been enqueued.
				res.Duplicated = append(res.Duplicated, it.msg.UUID)
			}
			opErr = fmt.Errorf("poison/admin: replay from %q stopped after %d of %d messages: publishing message %q: %w", queue, done, total, it.msg.UUID, err)
			break loop
		}
		// Confirmed: only now remove the poison copy.
		if err := it.d.Ack(false); err != nil {
			res.Duplicated = append(res.Duplicated, it.msg.UUID)
			opErr = fmt.Errorf("poison/admin: replay from %q stopped: message %q was replayed but could not be removed from the poison queue (it is now in both queues): %w", queue, it.msg.UUID, err)
			break
		}
		acked = append(acked, it.msg.UUID)
		res.Replayed++
		handled()
	}
	if err := a.finish(s, len(acked)); err != nil && len(acked) > 0 {
		// The close handshake failed: acks sent may not have been applied.
		res.Duplicated = append(res.Duplicated, acked...)
		if opErr == nil {
			opErr = fmt.Errorf("poison/admin: replay from %q: closing the channel failed, so the removal of the %d replayed messages from the poison queue is unconfirmed (they may be duplicated, never lost): %w", queue, len(acked), err)
		}
	}
	a.logger.Info("Replayed poisoned messages", watermill.LogFields{
		"queue": queue, "matched": res.Matched, "replayed": res.Replayed, "skipped": res.Skipped,
		"errors": len(res.Errors), "loop_back_exchange": a.cfg.LoopBackExchange,
	})
	return res, opErr
}

// Purge removes (acks) the messages of queue that f matches, at most
// f.Limit of them, and returns how many it removed; the others stay, as
// redeliveries. With dryRun it removes nothing and returns how many it
// would remove. A zero Filter removes every message ready when Purge
// started. Removed messages are gone for good.
//
// Errors: those of List; if ctx ends or the channel fails, Purge stops and
// returns the number removed so far with the error (when the final channel
// close fails, that number is unconfirmed).
func (a *Admin) Purge(ctx context.Context, queue string, f Filter, dryRun bool) (int, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	s, err := a.scanQueue(ctx, queue, f, nil)
	if err != nil {
		return 0, err
	}
	if dryRun {
		_ = a.finish(s, 0)
		return len(s.matched), nil
	}
	n := 0
	var opErr error
	for _, it := range s.matched {
		if err := ctx.Err(); err != nil {
			opErr = fmt.Errorf("poison/admin: purge of %q interrupted after %d of %d messages: %w", queue, n, len(s.matched), err)
			break
		}
		if err := it.d.Ack(false); err != nil {
			opErr = fmt.Errorf("poison/admin: purge of %q stopped after %d messages: %w", queue, n, err)
			break
		}
		n++
	}
	if err := a.finish(s, n); err != nil && opErr == nil && n > 0 {
		opErr = fmt.Errorf("poison/admin: purge of %q: closing the channel failed, so the removal of %d messages is unconfirmed: %w", queue, n, err)
	}
	a.logger.Info("Purged poisoned messages", watermill.LogFields{"queue": queue, "removed": n, "matched": len(s.matched)})
	return n, opErr
}

// Move moves the messages of queue from that f matches, at most f.Limit of
// them, to queue to: each is published unchanged (body, headers and
// properties, except user-id) to the default exchange with routing key to,
// with mandatory=true, and acked in from only after the broker confirmed
// it, so a message is never lost (at worst duplicated if the channel
// closes right after the confirm). It returns how many messages were moved;
// with dryRun, how many would be, without changing anything.
//
// Errors: a *NotFoundError matching ErrQueueNotFound naming from or to; an
// error if from == to; a Filter.Validate error; ErrClosed; ctx.Err()
// (Move stops before the next message; messages not moved stay in from);
// publish errors from amqpretry.ConfirmPublisher (the first one stops
// Move). The count returned with an error is the number moved so far.
func (a *Admin) Move(ctx context.Context, from, to string, f Filter, dryRun bool) (int, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if err := checkName("queue", to); err != nil {
		return 0, err
	}
	if from == to {
		return 0, fmt.Errorf("poison/admin: cannot move messages from queue %q to itself", from)
	}
	if _, err := a.inspectQueue(to); err != nil {
		return 0, err
	}
	s, err := a.scanQueue(ctx, from, f, nil)
	if err != nil {
		return 0, err
	}
	if dryRun {
		_ = a.finish(s, 0)
		return len(s.matched), nil
	}
	n := 0
	var opErr error
	pubCtx := context.WithoutCancel(ctx)
	for _, it := range s.matched {
		if err := ctx.Err(); err != nil {
			opErr = fmt.Errorf("poison/admin: move from %q to %q interrupted after %d of %d messages: %w", from, to, n, len(s.matched), err)
			break
		}
		h := cloneHeaders(it.d.Headers)
		delete(h, amqpretry.PublishIDHeader)
		if err := a.pub.PublishRaw(pubCtx, "", to, copyPublishing(it.d, h)); err != nil {
			opErr = fmt.Errorf("poison/admin: move from %q to %q stopped after %d messages: publishing message %q: %w", from, to, n, it.msg.UUID, err)
			break
		}
		if err := it.d.Ack(false); err != nil {
			opErr = fmt.Errorf("poison/admin: move from %q to %q stopped: message %q was copied to %q but could not be removed from %q (it is now in both): %w", from, to, it.msg.UUID, to, from, err)
			break
		}
		n++
	}
	if err := a.finish(s, n); err != nil && opErr == nil && n > 0 {
		opErr = fmt.Errorf("poison/admin: move from %q to %q: closing the channel failed, so the removal of %d moved messages from %q is unconfirmed (they may be duplicated, never lost): %w", from, to, n, from, err)
	}
	a.logger.Info("Moved poisoned messages", watermill.LogFields{"from": from, "to": to, "moved": n, "matched": len(s.matched)})
	return n, opErr
}
