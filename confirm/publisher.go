package confirm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Publisher publishes with RabbitMQ publisher confirms and
// mandatory=true, and reports per message whether the broker took
// responsibility for it (RabbitMQ guides "Consumer Acknowledgements and
// Publisher Confirms" and "Publishers").
//
// It is safe for concurrent use by many goroutines. Publishes are pipelined:
// on each of the Config.Channels channels up to 512 messages can be
// awaiting their confirm at once (amqp091-go's deferred confirmations); a
// per-channel lock is held only while a message is written, never while
// waiting for its confirm.
//
// A basic.return is matched to its publish by PublishIDHeader and read before
// the publish's confirm is looked at (the broker sends the return first), from
// a buffer as large as the number of publishes that can await a confirm, so
// amqp091-go never drops a return and an unroutable message is never reported
// as a success. No user code (the Logger) runs on that path.
//
// If a channel or the connection closes (channel error such as 404 on a
// missing exchange, network failure, broker restart), publishes waiting on it
// fail with ErrChannelClosed and the next publish transparently reopens the
// channel and, if needed, redials the connection (a few attempts with
// exponential backoff, 100ms..1s). No action is required by the caller.
//
// Flow control (RabbitMQ "Blocked Connection Notifications"): while the broker
// blocks the connection, publishes fail at once with ErrBlocked instead of
// writing to a socket the broker does not read; every socket write is bounded
// by ConfirmTimeout (ErrWriteTimeout), so a large message stuck in the write
// cannot hold the connection's send lock for longer.
//
// Every published message gets the PublishIDHeader header.
type Publisher struct {
	cfg      Config
	log      *asyncLog
	instance string

	// ctx is cancelled by Close; it aborts reconnect backoff.
	ctx    context.Context
	cancel context.CancelFunc

	// lifeMu guards closed and the Add side of inflight.
	lifeMu   sync.RWMutex
	closed   bool
	inflight sync.WaitGroup

	closeOnce sync.Once
	closeErr  error

	// dialMu serialises (re)dialling; connMu guards conn only briefly.
	dialMu sync.Mutex
	connMu sync.Mutex
	conn   *pubConn

	slots []*pubSlot
	next  atomic.Uint64

	// Test hooks, set before the first publish. testHookWritten runs after
	// a message was written; testHookGiveUp runs when a publish stops
	// waiting (timeout, ctx, block) before it checks its confirm a last
	// time, with the confirm's done channel.
	testHookWritten func()
	testHookGiveUp  func(confirmed <-chan struct{})
}

// New applies defaults to cfg, validates it, dials the broker
// and opens cfg.Channels channels in confirm mode. It returns the Validate
// error for a bad config, or the dial/channel error if the broker is
// unreachable (no retry at construction time).
func New(cfg Config) (*Publisher, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var rnd [6]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, fmt.Errorf("confirm: generating publisher instance id: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{
		cfg:      cfg,
		log:      newAsyncLog(cfg.Logger),
		instance: hex.EncodeToString(rnd[:]),
		ctx:      ctx,
		cancel:   cancel,
	}
	p.slots = make([]*pubSlot, cfg.Channels)
	for i := range p.slots {
		p.slots[i] = &pubSlot{p: p, index: i, sem: make(chan struct{}, 1)}
	}
	if _, err := p.connection(); err != nil {
		cancel()
		p.log.stop()
		return nil, err
	}
	for _, s := range p.slots {
		st, err := s.open()
		if err != nil {
			_ = p.Close()
			return nil, fmt.Errorf("confirm: opening publisher channel %d: %w", s.index, err)
		}
		s.state.Store(st)
	}
	return p, nil
}

// begin registers an in-flight operation; it returns ErrClosed after Close.
func (p *Publisher) begin() error {
	p.lifeMu.RLock()
	defer p.lifeMu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	p.inflight.Add(1)
	return nil
}

func (p *Publisher) isClosed() bool {
	p.lifeMu.RLock()
	defer p.lifeMu.RUnlock()
	return p.closed
}

// Close stops accepting publishes (new calls return ErrClosed), waits up to
// ConfirmTimeout for in-flight publishes to get their confirms, then closes
// the connection and with it all channels (the connection.close handshake is
// bounded by 5s; skipped while the broker blocks the connection, since it
// would not be answered). Publishes still waiting after that fail with both
// ErrChannelClosed and ErrClosed. Close is idempotent; later calls return the
// first call's result. An already-lost connection is not an error; a failed
// close handshake is returned wrapped.
func (p *Publisher) Close() error {
	p.closeOnce.Do(func() {
		p.lifeMu.Lock()
		p.closed = true
		p.lifeMu.Unlock()

		done := make(chan struct{})
		go func() {
			p.inflight.Wait()
			close(done)
		}()
		// Abort reconnect backoff now: publishes that still need a channel
		// would get ErrClosed anyway. Waiting for confirms is unaffected.
		p.cancel()
		timer := time.NewTimer(p.cfg.ConfirmTimeout)
		select {
		case <-done:
		case <-timer.C:
			p.log.info("Publisher.Close: in-flight publishes did not finish within ConfirmTimeout; closing anyway", nil)
		}
		timer.Stop()

		p.connMu.Lock()
		pc := p.conn
		p.conn = nil
		p.connMu.Unlock()
		if pc != nil && !pc.c.IsClosed() {
			_, blocked := pc.blockState()
			deadline := time.Now().Add(connectionCloseTimeout)
			if blocked {
				deadline = time.Now() // the broker does not read: just close the socket
			}
			if err := pc.c.CloseDeadline(deadline); err != nil && !errors.Is(err, amqp.ErrClosed) && !blocked {
				p.closeErr = fmt.Errorf("confirm: closing publisher connection: %w", err)
			}
		}
		// Channels die with the connection: their deferred confirmations
		// resolve (nack), and every publish still waiting returns.
		p.log.stop()
	})
	return p.closeErr
}

func (p *Publisher) pickSlot() *pubSlot {
	n := uint64(len(p.slots))
	return p.slots[(p.next.Add(1)-1)%n]
}
