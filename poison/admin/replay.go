package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"
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
	// messages stay in the poison queue, except those in Duplicated (their
	// MessageError matches ErrMaybeDuplicated).
	Errors []error `json:"-"`
	// Duplicated lists the UUIDs of the messages that may now be both in
	// their original queue and in the poison queue (see
	// ErrMaybeDuplicated): at most the one being replayed when Replay
	// stopped because a channel or the connection closed, or a confirm timed
	// out. Never a loss. Each is counted in Left, not in Replayed.
	Duplicated []string `json:"duplicated,omitempty"`
	// Left is the number of matched messages whose removal from the poison
	// queue was not confirmed: Matched - Replayed, that is the skipped and
	// failed ones, those not reached when Replay stopped, and those in
	// Duplicated (which may in fact have been removed). In DryRun, the
	// number that would be left (the skipped ones).
	Left int `json:"left"`
}

var (
	// ErrMaybeDuplicated marks, in a *MessageError, a message that Replay
	// or Move could not settle because the channel reading the source queue
	// or the connection closed (or a publisher confirm timed out) while it
	// was handled: its copy was confirmed, or written without a confirm,
	// but its removal from the source queue was not confirmed. It may be
	// in both queues; it is in at least one.
	ErrMaybeDuplicated = errors.New("message may be in both queues: its copy was (or may have been) enqueued, its removal from the source queue is unconfirmed")

	// ErrRemovalUnconfirmed marks, in a *MessageError, the message Purge
	// was removing when the channel or the connection closed: its ack was
	// sent but the broker did not confirm processing it, so it may still
	// be in the queue. It is not counted as removed.
	ErrRemovalUnconfirmed = errors.New("message removal unconfirmed: the channel closed after its ack was sent")
)

// replayDropsHeader reports whether Replay leaves the header k off the copy
// it publishes: every retry-state key (middleware.IsRetryState: the poison
// marks, so the message no longer looks poisoned; the attempt number,
// redelivery count and delay, so the next delivery is attempt 1 with the
// whole MaxRedeliveries allowance; the broker's x-death, x-delivery-count,
// x-acquired-count, x-first-death-* and x-last-death-*, which would make the
// retry middleware count earlier attempts), and the poison publish's
// confirm.PublishIDHeader. The failure history (first/last failure, last
// error, error class, original queue/exchange/routing key) is kept.
func replayDropsHeader(k string) bool {
	return middleware.IsRetryState(k) || k == confirm.PublishIDHeader
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

// replayPublishing is the copy Replay publishes: headers minus those
// replayDropsHeader names, plus rabbitretry-replayed = now (RFC 3339, UTC).
func replayPublishing(d amqp.Delivery, now time.Time) amqp.Publishing {
	h := cloneHeaders(d.Headers)
	for k := range h {
		if replayDropsHeader(k) {
			delete(h, k)
		}
	}
	h[middleware.ReplayedKey] = now.UTC().Format(time.RFC3339)
	return copyPublishing(d, h)
}

// perMessage reports publish errors caused by the message or its
// destination; any other error (channel or connection closed, confirm
// timeout, publisher closed) stops the operation.
func perMessage(err error) bool {
	return errors.Is(err, confirm.ErrUnroutable) || errors.Is(err, confirm.ErrNacked)
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
// rabbitretry-replayed = the replay time (RFC 3339), and loses every
// retry-state key (middleware.IsRetryState): the poison-only keys
// (reason_poisoned, topic_poisoned, handler_poisoned, subscriber_poisoned,
// rabbitretry-attempts, rabbitretry-poisoned-at), the attempt number
// rabbitretry-attempt and the redelivery count rabbitretry-redeliveries (so
// the next delivery is attempt 1, with the whole MaxRedeliveries allowance)
// and the broker's headers (x-death, x-delivery-count, x-acquired-count,
// x-first-death-*, x-last-death-*). Non-matching messages stay in the
// poison queue, as redeliveries.
//
// The matching messages are collected first, reading at most the queue
// depth at the start, so Replay terminates even though requeued messages
// are immediately available again; then they are replayed one by one.
//
// A message without destination is skipped (ErrNoOriginalQueue); one the
// broker returns as unroutable (its queue is not bound to the loop-back
// exchange: confirm.ErrUnroutable) or nacks (confirm.ErrNacked) is left
// in place; both are reported in ReplayResult.Errors and Replay continues.
// Other failures stop Replay and are returned with the partial result.
// Canceling ctx stops Replay before the next message (a publish in progress
// still waits for its confirm, at most 30s, so it is not duplicated) and
// returns ctx.Err() wrapped with the partial result; everything not
// replayed stays in the poison queue.
//
// Every ack is confirmed before the next message is published (a
// synchronous no-op on the reading channel after it: AMQP does not confirm
// acks, but a channel processes its methods in order), and the reading
// channel is checked before every publish. So if the channel reading the
// poison queue or the connection closes, Replay publishes nothing more
// (the publisher would redial on its own: its copies could no longer be
// removed from the poison queue) and returns; the broker returns the
// messages not removed to the poison queue. Replayed then counts exactly
// the messages whose copy and whose removal were both confirmed, Left the
// others, and Duplicated holds at most the one message in flight (copy
// enqueued or possibly enqueued, removal unconfirmed).
//
// Errors: a *notFoundError matching ErrQueueNotFound (queue missing) or
// ErrExchangeNotFound (loop-back exchange missing; nothing is changed); a
// Filter.Validate error; middleware.ErrClosed (wrapped); ctx.Err(); channel, connection or
// confirm errors (confirm.ErrChannelClosed, confirm.ErrConfirmTimeout).
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
		res.Left = res.Matched - res.Replayed
		_ = a.finish(s, 0)
		return res, nil
	}

	var (
		opErr   error
		done    int
		pubCtx  = context.WithoutCancel(ctx)
		total   = res.Matched
		handled = func() {
			done++
			if opts.Progress != nil {
				opts.Progress(done, total)
			}
		}
		// maybeDuplicated records the message in flight when Replay
		// stopped, whose copy is (or may be) enqueued and whose removal
		// is unconfirmed.
		maybeDuplicated = func(it item, to string, cause error) {
			res.Duplicated = append(res.Duplicated, it.msg.UUID)
			res.Errors = append(res.Errors, &MessageError{UUID: it.msg.UUID, Queue: to, Err: fmt.Errorf("%w: %w", ErrMaybeDuplicated, cause)})
			a.logger.Error("Replay stopped with a message possibly in both queues", cause, watermill.LogFields{
				"queue": queue, "message_uuid": it.msg.UUID, "to_queue": to,
			})
		}
	)
	stopped := func(what string, err error) error {
		return fmt.Errorf("poison/admin: replay from %q stopped after %d of %d messages (%d replayed; the rest are still in the poison queue): %s: %w",
			queue, done, total, res.Replayed, what, err)
	}
loop:
	for _, it := range s.matched {
		if err := ctx.Err(); err != nil {
			opErr = fmt.Errorf("poison/admin: replay from %q interrupted after %d of %d messages: %w", queue, done, total, err)
			break
		}
		a.at("next", done)
		to := dest(it.msg)
		if to == "" {
			res.Skipped++
			res.Errors = append(res.Errors, &MessageError{UUID: it.msg.UUID, Err: ErrNoOriginalQueue})
			handled()
			continue
		}
		// The publisher redials on its own, so a publish would succeed
		// even though the message can no longer be removed.
		if err := s.alive(); err != nil {
			opErr = stopped("nothing more was published", err)
			break
		}
		a.at("publish", done)
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
		case errors.Is(err, confirm.ErrConfirmTimeout) || errors.Is(err, confirm.ErrChannelClosed):
			// Written but unconfirmed: the copy may have been enqueued.
			maybeDuplicated(it, to, err)
			opErr = stopped(fmt.Sprintf("publishing message %q", it.msg.UUID), err)
			break loop
		default:
			res.Errors = append(res.Errors, &MessageError{UUID: it.msg.UUID, Queue: to, Err: err})
			opErr = stopped(fmt.Sprintf("publishing message %q", it.msg.UUID), err)
			break loop
		}
		// Confirmed: only now remove the poison copy.
		a.at("ack", done)
		if err := s.remove(a, it, done); err != nil {
			maybeDuplicated(it, to, err)
			opErr = stopped(fmt.Sprintf("message %q was replayed but its removal from the poison queue is unconfirmed (it may be in both queues)", it.msg.UUID), err)
			break
		}
		res.Replayed++
		handled()
	}
	res.Left = res.Matched - res.Replayed
	if err := a.finish(s, res.Replayed+len(res.Duplicated)); err != nil {
		a.logger.Debug("Releasing the poison queue's channel failed; the broker requeues its messages", watermill.LogFields{
			"queue": queue, "error": err.Error(),
		})
	}
	a.logger.Info("Replayed poisoned messages", watermill.LogFields{
		"queue": queue, "matched": res.Matched, "replayed": res.Replayed, "skipped": res.Skipped, "left": res.Left,
		"duplicated": len(res.Duplicated), "errors": len(res.Errors), "loop_back_exchange": a.cfg.LoopBackExchange,
	})
	return res, opErr
}

// Purge removes (acks) the messages of queue that f matches, at most
// f.Limit of them, and returns how many it removed; the others stay, as
// redeliveries. With dryRun it removes nothing and returns how many it
// would remove. A zero Filter removes every message ready when Purge
// started. Removed messages are gone for good.
//
// Each removal is confirmed before the next (see Replay). If ctx ends, or
// the channel reading the queue or the connection closes, Purge stops and
// returns the number of removals confirmed so far with the error; the
// broker returns the messages not removed to the queue. When the channel
// closed right after an ack was sent, that message may or may not have
// been removed: it is not counted, and the error wraps a *MessageError
// naming it that matches ErrRemovalUnconfirmed.
//
// Errors: those of List; ctx.Err() (wrapped); channel or connection errors.
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
	n, unconfirmed := 0, 0
	var opErr error
	for _, it := range s.matched {
		if err := ctx.Err(); err != nil {
			opErr = fmt.Errorf("poison/admin: purge of %q interrupted after %d of %d messages: %w", queue, n, len(s.matched), err)
			break
		}
		a.at("next", n)
		if err := s.alive(); err != nil {
			opErr = fmt.Errorf("poison/admin: purge of %q stopped after %d of %d messages (the rest are still in the queue): %w", queue, n, len(s.matched), err)
			break
		}
		a.at("ack", n)
		if err := s.remove(a, it, n); err != nil {
			if !errors.Is(err, errAckNotSent) {
				unconfirmed++
				err = &MessageError{UUID: it.msg.UUID, Err: fmt.Errorf("%w: %w", ErrRemovalUnconfirmed, err)}
			}
			opErr = fmt.Errorf("poison/admin: purge of %q stopped after %d of %d messages (the rest are still in the queue): %w", queue, n, len(s.matched), err)
			break
		}
		n++
	}
	if err := a.finish(s, n+unconfirmed); err != nil {
		a.logger.Debug("Releasing the queue's channel failed; the broker requeues its messages", watermill.LogFields{
			"queue": queue, "error": err.Error(),
		})
	}
	a.logger.Info("Purged poisoned messages", watermill.LogFields{"queue": queue, "removed": n, "matched": len(s.matched), "unconfirmed": unconfirmed})
	return n, opErr
}

// Move moves the messages of queue from that f matches, at most f.Limit of
// them, to queue to: each is published unchanged (body, headers and
// properties, except user-id) to the default exchange with routing key to,
// with mandatory=true, and acked in from only after the broker confirmed
// it, so a message is never lost. It returns how many messages were moved
// (copy and removal both confirmed); with dryRun, how many would be,
// without changing anything.
//
// Like Replay, Move confirms each removal before the next publish and stops
// as soon as the channel reading from or the connection closes. The
// message in flight then, whose copy was (or may have been) enqueued but
// whose removal is unconfirmed, may be in both queues: it is not counted,
// and the error wraps a *MessageError naming it that matches
// ErrMaybeDuplicated.
//
// Errors: a *notFoundError matching ErrQueueNotFound naming from or to; an
// error if from == to; an invalid Filter (negative Limit, Since after Until); ErrClosed; ctx.Err()
// (Move stops before the next message; messages not moved stay in from);
// publish errors from confirm.Publisher (the first one stops
// Move); channel or connection errors. The count returned with an error is
// the number moved so far.
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
	n, inDoubt := 0, 0
	var opErr error
	pubCtx := context.WithoutCancel(ctx)
	stopped := func(what string, err error) error {
		return fmt.Errorf("poison/admin: move from %q to %q stopped after %d of %d messages (the rest are still in %q): %s: %w",
			from, to, n, len(s.matched), from, what, err)
	}
	maybeDuplicated := func(it item, err error) error {
		inDoubt++
		return &MessageError{UUID: it.msg.UUID, Queue: to, Err: fmt.Errorf("%w: %w", ErrMaybeDuplicated, err)}
	}
	for _, it := range s.matched {
		if err := ctx.Err(); err != nil {
			opErr = fmt.Errorf("poison/admin: move from %q to %q interrupted after %d of %d messages: %w", from, to, n, len(s.matched), err)
			break
		}
		a.at("next", n)
		if err := s.alive(); err != nil {
			opErr = stopped("nothing more was copied", err)
			break
		}
		h := cloneHeaders(it.d.Headers)
		delete(h, confirm.PublishIDHeader)
		a.at("publish", n)
		if err := a.pub.PublishRaw(pubCtx, "", to, copyPublishing(it.d, h)); err != nil {
			if errors.Is(err, confirm.ErrConfirmTimeout) || errors.Is(err, confirm.ErrChannelClosed) {
				err = maybeDuplicated(it, err) // written but unconfirmed
			}
			opErr = stopped(fmt.Sprintf("copying message %q", it.msg.UUID), err)
			break
		}
		a.at("ack", n)
		if err := s.remove(a, it, n); err != nil {
			opErr = stopped(fmt.Sprintf("message %q was copied to %q but its removal from %q is unconfirmed (it may be in both)", it.msg.UUID, to, from), maybeDuplicated(it, err))
			break
		}
		n++
	}
	if err := a.finish(s, n+inDoubt); err != nil {
		a.logger.Debug("Releasing the source queue's channel failed; the broker requeues its messages", watermill.LogFields{
			"queue": from, "error": err.Error(),
		})
	}
	a.logger.Info("Moved poisoned messages", watermill.LogFields{"from": from, "to": to, "moved": n, "matched": len(s.matched), "in_doubt": inDoubt})
	return n, opErr
}
