package confirm

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"
)

// chanState is one incarnation of an AMQP channel in confirm mode.
//
// Return correlation: every publish holds one of tokens from before its
// write until its deferred confirmation is done and the returns buffer was
// drained after that. The broker sends a message's basic.return before its
// basic.ack, and amqp091-go's reader hands the return to returns before it
// resolves the deferred confirmation; so a return is in returns (or already
// in returned) by the time its publish sees the confirmation done, and the
// buffer never holds more returns than there are tokens: it never fills.
type chanState struct {
	slot    *pubSlot
	conn    *pubConn
	ch      *amqp.Channel
	tokens  chan struct{}
	closes  chan *amqp.Error
	returns chan amqp.Return // read only under mu; nil once closed
	dead    atomic.Bool      // abandoned (see acquire): reopen on the next publish

	mu          sync.Mutex
	returned    map[string]amqp.Return // publish id -> its basic.return
	reason      *amqp.Error
	reasonKnown bool
}

// acquire takes a token for one publish awaiting its confirm. Without wait
// it returns errNoToken if none is free. Waiting is bounded by timeout: a
// channel whose publishes all stay unconfirmed that long is abandoned
// (closed in the background, which fails its pending publishes with
// ErrChannelClosed; the next publish opens a new one), and acquire returns
// ErrConfirmTimeout (wrapped); nothing was written.
func (st *chanState) acquire(ctx context.Context, wait bool, timeout time.Duration) error {
	select {
	case st.tokens <- struct{}{}:
		return nil
	default:
	}
	if !wait {
		return errNoToken
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case st.tokens <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		if st.dead.CompareAndSwap(false, true) {
			go func() { _ = st.ch.Close() }()
		}
		return fmt.Errorf("%w: channel %d had %d publishes awaiting their confirms for %s; message not sent, channel abandoned",
			ErrConfirmTimeout, st.slot.index, cap(st.tokens), timeout)
	}
}

func (st *chanState) release() { <-st.tokens }

// takeReturn moves the buffered returns into st.returned and removes and
// returns the one for publish id, if any.
func (st *chanState) takeReturn(id string) (amqp.Return, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
drain:
	for st.returns != nil {
		select {
		case r, ok := <-st.returns:
			if !ok {
				st.returns = nil // channel closed; everything it sent was read
				break drain
			}
			rid, _ := r.Headers[PublishIDHeader].(string)
			st.returned[rid] = r
		default:
			break drain
		}
	}
	r, ok := st.returned[id]
	delete(st.returned, id)
	return r, ok
}

// closeReason returns the broker's reason for closing the channel (or its
// connection), if it closed with one. amqp091-go sends it to closes before
// it resolves the pending deferred confirmations.
func (st *chanState) closeReason() *amqp.Error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if !st.reasonKnown {
		select {
		case e, ok := <-st.closes:
			if ok {
				st.reason = e
			}
			st.reasonKnown = true
		default:
		}
	}
	return st.reason
}

// pending is one written publish awaiting its deferred confirmation.
type pending struct {
	st       *chanState
	dc       *amqp.DeferredConfirmation
	id       string
	exchange string
	key      string
}

// wrap adds the exchange and key to a sentinel error.
func (w *pending) wrap(err error) error {
	return fmt.Errorf("%w: exchange %q, routing key %q", err, w.exchange, w.key)
}

// wait blocks until the confirm, ctx end, timeout, or the connection has
// been blocked for blockedGrace.
func (w *pending) wait(ctx context.Context, timeout <-chan time.Time) error {
	blockedC, _ := w.st.conn.blockState()
	var grace <-chan time.Time
	for {
		select {
		case <-w.dc.Done():
			return w.result()
		case <-timeout:
			return w.giveUp(fmt.Errorf("%w: exchange %q, routing key %q, delivery tag %d",
				ErrConfirmTimeout, w.exchange, w.key, w.dc.DeliveryTag))
		case <-ctx.Done():
			return w.giveUp(fmt.Errorf("confirm: waiting for publisher confirm (exchange %q, routing key %q): %w",
				w.exchange, w.key, ctx.Err()))
		case <-blockedC:
			// Messages the broker read before it blocked are confirmed at
			// once; later ones wait for the unblock. Give it a moment.
			blockedC = nil
			t := time.NewTimer(blockedGrace)
			defer t.Stop()
			grace = t.C
		case <-grace:
			grace = nil
			if err := w.st.conn.blockedErr("no confirm for a message written before the block; outcome unknown"); err != nil {
				return w.giveUp(w.wrap(err))
			}
			blockedC, _ = w.st.conn.blockState() // unblocked meanwhile: keep waiting
		}
	}
}

// giveUp ends the wait with err, unless the confirm arrived after all (it
// may have arrived just as the deadline fired): the broker's answer wins.
// An abandoned publish keeps its token until its confirm resolves (the
// channel's closing resolves it at the latest), so its return, if one comes,
// still has room in the buffer.
func (w *pending) giveUp(err error) error {
	if h := w.st.slot.p.testHookGiveUp; h != nil {
		h(w.dc.Done())
	}
	select {
	case <-w.dc.Done():
		return w.result()
	default:
	}
	go func() {
		<-w.dc.Done()
		r, returned := w.st.takeReturn(w.id)
		w.st.release()
		if returned {
			w.st.slot.p.log.debug("basic.return for an abandoned publish", watermill.LogFields{
				"publish_id": w.id, "exchange": r.Exchange, "routing_key": r.RoutingKey,
			})
		}
	}()
	return err
}

// result evaluates a done deferred confirmation: returned, acked, nacked by
// the broker, or failed by the channel's closing.
func (w *pending) result() error {
	r, returned := w.st.takeReturn(w.id)
	w.st.release()
	switch {
	case returned:
		return fmt.Errorf("%w: exchange %q, routing key %q: %d %s",
			ErrUnroutable, w.exchange, w.key, r.ReplyCode, r.ReplyText)
	case w.dc.Acked():
		return nil
	case w.st.ch.IsClosed():
		// amqp091-go nacks the pending confirmations of a closed channel.
		var cause error
		switch reason := w.st.closeReason(); {
		case reason != nil:
			cause = fmt.Errorf("%w: %w", ErrChannelClosed, reason)
		case w.st.slot.p.isClosed():
			cause = fmt.Errorf("%w: %w", ErrChannelClosed, ErrClosed)
		default:
			cause = ErrChannelClosed
		}
		return fmt.Errorf("confirm: exchange %q, routing key %q: %w", w.exchange, w.key, cause)
	default:
		return fmt.Errorf("%w: exchange %q, routing key %q", ErrNacked, w.exchange, w.key)
	}
}
