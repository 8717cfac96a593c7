package confirm

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
)

// PublishRaw publishes msg to exchange with routing key key and
// mandatory=true on a confirm-mode channel, and returns nil only after the
// broker confirmed it with basic.ack and did not return it with basic.return
// (per the RabbitMQ "Publishers" and "Consumer Acknowledgements and Publisher
// Confirms" guides, a returned mandatory message is still acked, and the
// return is sent before the ack). The PublishIDHeader header is added to a
// copy of msg.Headers; msg itself is not modified.
//
// A confirm that arrives while the publish stops waiting (timeout, ctx,
// block) is never lost: the publish checks its confirm once more before it
// reports a failure, so an acked message is reported as published.
//
// Errors (test with errors.Is / errors.As):
//   - ErrUnroutable: the broker returned the message (no queue matched);
//     the error text names exchange, key and the broker's reply.
//   - ErrNacked: the broker answered with basic.nack.
//   - ErrConfirmTimeout: no confirm within Config.ConfirmTimeout;
//     or (text "message not sent") the channel had 512 publishes awaiting
//     confirms for that long, so nothing was written and the channel is
//     replaced.
//   - ErrChannelClosed (possibly wrapping *amqp.Error, e.g. code 404 for a
//     missing exchange): the channel/connection closed before the confirm.
//   - ErrBlocked: the broker blocks the connection (flow control); nothing
//     was written, or (written before the block) no confirm within 1 s.
//   - ErrWriteTimeout: a socket write did not finish within ConfirmTimeout
//     (at least 1 s); the connection was closed and the message not
//     (completely) sent.
//   - ctx.Err() (wrapped) if ctx ends before the confirm arrived.
//   - ErrClosed after Close; a dial/channel error if the channel could not
//     be (re)opened after a few attempts; an amqp error for invalid headers.
//
// For ErrConfirmTimeout, ErrChannelClosed, ctx errors after the write and
// ErrBlocked after the write, the message may or may not have been enqueued;
// treat it as failed.
func (p *Publisher) PublishRaw(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if err := p.begin(); err != nil {
		return err
	}
	defer p.inflight.Done()

	prepared, err := prepareMessage(msg)
	if err != nil {
		return err
	}
	s := p.pickSlot()
	w, err := s.send(ctx, exchange, key, prepared, true)
	if err != nil {
		return err
	}
	timer := time.NewTimer(p.cfg.ConfirmTimeout)
	defer timer.Stop()
	return w.wait(ctx, timer.C)
}

// PublishRawBatch publishes all msgs to the same exchange and routing key
// like PublishRaw, writing them back to back on one channel (pipelined) and
// then waiting for all confirms; ConfirmTimeout is measured from the last
// write (from the last write of each group of up to 512 messages for larger
// batches). It returns nil if every message was confirmed and none returned,
// otherwise errors.Join of one error per failed message, each prefixed with
// the message's index in msgs (errors.Is works on the joined error). If
// writing stops early (ctx done, channel cannot be reopened, ErrClosed,
// ErrBlocked), the unwritten messages fail with that error. An empty msgs
// returns nil.
func (p *Publisher) PublishRawBatch(ctx context.Context, exchange, key string, msgs []amqp.Publishing) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if err := p.begin(); err != nil {
		return err
	}
	defer p.inflight.Done()
	if len(msgs) == 0 {
		return nil
	}

	s := p.pickSlot()
	waiters := make([]*pending, len(msgs))
	errs := make([]error, len(msgs))
	var group []int
	// flush waits for the confirms of the messages written so far.
	flush := func() {
		timer := time.NewTimer(p.cfg.ConfirmTimeout)
		defer timer.Stop()
		var stop error // once one timed out or was blocked, the rest don't wait
		for _, i := range group {
			w := waiters[i]
			if stop != nil {
				errs[i] = w.giveUp(w.wrap(stop))
				continue
			}
			errs[i] = w.wait(ctx, timer.C)
			switch {
			case errors.Is(errs[i], ErrConfirmTimeout):
				stop = ErrConfirmTimeout
			case errors.Is(errs[i], ErrBlocked):
				stop = ErrBlocked
			}
		}
		group = group[:0]
	}
	for i := range msgs {
		prepared, err := prepareMessage(msgs[i])
		if err != nil {
			errs[i] = err // specific to this message; go on with the rest
			continue
		}
		w, err := s.send(ctx, exchange, key, prepared, false)
		if errors.Is(err, errNoToken) {
			// This channel has the maximum of publishes awaiting confirms:
			// settle ours before waiting for a slot (never wait while
			// holding slots only our own waiting would free).
			flush()
			w, err = s.send(ctx, exchange, key, prepared, true)
		}
		if err != nil {
			// ctx done, ErrClosed, ErrBlocked, or the channel could not be
			// reopened: do not retry (and reopen) for every remaining message.
			for j := i; j < len(msgs); j++ {
				if errs[j] == nil {
					errs[j] = err
				}
			}
			break
		}
		waiters[i] = w
		group = append(group, i)
	}
	flush()

	var joined []error
	for i, err := range errs {
		if err != nil {
			joined = append(joined, fmt.Errorf("message %d: %w", i, err))
		}
	}
	return errors.Join(joined...)
}

// prepareMessage returns msg with a private copy of its headers (room for
// PublishIDHeader) after checking that all header values are AMQP-encodable.
func prepareMessage(msg amqp.Publishing) (amqp.Publishing, error) {
	headers := make(amqp.Table, len(msg.Headers)+1)
	maps.Copy(headers, msg.Headers)
	if err := headers.Validate(); err != nil {
		return msg, fmt.Errorf("confirm: invalid message headers: %w", err)
	}
	msg.Headers = headers
	return msg, nil
}

// pubSlot is one of the publisher's channel positions. The AMQP channel in it
// is replaced when it dies.
type pubSlot struct {
	p     *Publisher
	index int

	// sem is the per-channel write lock (a 1-buffered channel so waiting for
	// it honours ctx). It serialises publishes on the channel and reopening.
	sem   chan struct{}
	seq   uint64 // guarded by sem
	state atomic.Pointer[chanState]
}

// open opens a new confirm-mode channel with its return buffer.
func (s *pubSlot) open() (*chanState, error) {
	pc, err := s.p.connection()
	if err != nil {
		return nil, err
	}
	if err := pc.blockedErr("opening a publisher channel"); err != nil {
		return nil, err
	}
	var ch *amqp.Channel
	var closes chan *amqp.Error
	err = pc.bounded(s.p.ioTimeout(), func() error {
		var err error
		if ch, err = pc.c.Channel(); err != nil {
			return fmt.Errorf("confirm: opening channel: %w", err)
		}
		closes = ch.NotifyClose(make(chan *amqp.Error, 1))
		if err := ch.Confirm(false); err != nil {
			_ = ch.Close()
			return fmt.Errorf("confirm: enabling publisher confirms: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	st := &chanState{
		slot: s,
		conn: pc,
		ch:   ch,
		// Buffered for every publish that may await its confirm (tokens):
		// amqp091-go hands a basic.return over without ever waiting, so it
		// never drops one (it drops a return a listener has not taken
		// within 5 s).
		returns:  ch.NotifyReturn(make(chan amqp.Return, s.p.cfg.maxInFlight)),
		tokens:   make(chan struct{}, s.p.cfg.maxInFlight),
		closes:   closes,
		returned: make(map[string]amqp.Return),
	}
	if s.p.isClosed() {
		// Close may have run while we were opening; don't leak the channel.
		_ = ch.Close()
		return nil, ErrClosed
	}
	return st, nil
}

// ensureOpen returns a usable channel state, reopening (and redialling) with
// bounded exponential backoff if the current one is closed. Caller holds sem.
func (s *pubSlot) ensureOpen(ctx context.Context) (*chanState, error) {
	old := s.state.Load()
	if old != nil && !old.dead.Load() && !old.ch.IsClosed() {
		return old, nil
	}
	if s.p.isClosed() {
		return nil, ErrClosed
	}
	if old != nil {
		if reason := old.closeReason(); reason != nil {
			s.p.log.error("AMQP publisher channel closed", reason, watermill.LogFields{"channel": s.index})
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(s.p.ctx, cancel)
	defer stop()

	eb := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(reopenInitialInterval),
		backoff.WithMaxInterval(reopenMaxInterval),
		backoff.WithMaxElapsedTime(0),
	)
	b := backoff.WithContext(backoff.WithMaxRetries(eb, reopenAttempts-1), ctx)
	st, err := backoff.RetryNotifyWithData(func() (*chanState, error) {
		if s.p.isClosed() {
			return nil, backoff.Permanent(ErrClosed)
		}
		st, err := s.open()
		if errors.Is(err, ErrClosed) || errors.Is(err, ErrBlocked) {
			return nil, backoff.Permanent(err)
		}
		return st, err
	}, b, func(err error, d time.Duration) {
		s.p.log.error("Reopening AMQP publisher channel failed, retrying", err,
			watermill.LogFields{"channel": s.index, "retry_in": d.String()})
	})
	if err != nil {
		if s.p.isClosed() {
			return nil, ErrClosed
		}
		if errors.Is(err, ErrBlocked) {
			return nil, err
		}
		if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
			err = fmt.Errorf("%w (last error: %w)", ctxErr, err)
		}
		return nil, fmt.Errorf("confirm: reopening publisher channel %d: %w", s.index, err)
	}
	s.state.Store(st)
	s.p.log.info("AMQP publisher channel (re)opened", watermill.LogFields{"channel": s.index})
	return st, nil
}

// errNoToken: the channel has maxInFlightPerChannel publishes awaiting
// confirms and the caller asked not to wait (PublishRawBatch).
var errNoToken = errors.New("confirm: channel at its limit of publishes awaiting confirms")

// send writes one message (prepared by prepareMessage, so its Headers map is
// private and writable) and returns the pending publish. With waitToken
// false it returns errNoToken instead of waiting for one of the channel's
// slots for publishes awaiting confirms.
func (s *pubSlot) send(ctx context.Context, exchange, key string, msg amqp.Publishing, waitToken bool) (*pending, error) {
	if pc := s.p.current(); pc != nil {
		if err := pc.blockedErr(fmt.Sprintf("publish to exchange %q with routing key %q refused", exchange, key)); err != nil {
			return nil, err
		}
	}
	select {
	case s.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-s.sem }()

	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		st, err := s.ensureOpen(ctx)
		if err != nil {
			return nil, err
		}
		if err := st.conn.blockedErr(fmt.Sprintf("publish to exchange %q with routing key %q refused", exchange, key)); err != nil {
			return nil, err
		}
		if err := st.acquire(ctx, waitToken, s.p.cfg.ConfirmTimeout); err != nil {
			if errors.Is(err, ErrConfirmTimeout) {
				err = fmt.Errorf("confirm: publishing to exchange %q with routing key %q: %w", exchange, key, err)
			}
			return nil, err
		}
		s.seq++
		id := s.p.instance + "-" + strconv.Itoa(s.index) + "-" + strconv.FormatUint(s.seq, 10)
		msg.Headers[PublishIDHeader] = id
		dc, err := st.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
		if err == nil && dc == nil {
			err = errors.New("confirm: channel not in confirm mode") // cannot happen: open enables it
		}
		if err == nil {
			if s.p.testHookWritten != nil {
				s.p.testHookWritten()
			}
			return &pending{st: st, dc: dc, id: id, exchange: exchange, key: key}, nil
		}
		// Nothing of this message reached the broker complete: amqp091-go
		// rolled its deferred confirmation back.
		st.release()
		switch {
		case errors.Is(err, amqp.ErrClosed):
			// Channel closed before the write: the message was not sent,
			// retrying on a fresh channel is safe.
			lastErr = err
			continue
		case errors.Is(err, os.ErrDeadlineExceeded):
			err = fmt.Errorf("%w after %s (connection closed): %w", ErrWriteTimeout, s.p.ioTimeout(), err)
			if berr := st.conn.blockedErr("the broker stopped reading"); berr != nil {
				err = fmt.Errorf("%w; %w", err, berr)
			}
		}
		return nil, fmt.Errorf("confirm: publishing to exchange %q with routing key %q: %w", exchange, key, err)
	}
	return nil, fmt.Errorf("confirm: publishing to exchange %q with routing key %q: channel kept closing: %w", exchange, key, lastErr)
}
