package amqpretry

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
)

// PublishIDHeader is the AMQP header that ConfirmPublisher adds to every
// message it publishes. Its value is a string "<instance>-<channel-index>-<seq>"
// that is unique per publish attempt within one ConfirmPublisher (the
// <instance> part is random per ConfirmPublisher, so values from different
// publishers practically never collide).
//
// The header exists so that a basic.return (which carries the returned
// message's properties but no delivery tag) can be matched to the delivery tag
// of the publish it belongs to; see the RabbitMQ "Publishers" guide, section
// on unroutable messages and the mandatory flag.
//
// The broker cannot strip headers, so the header stays on the delivered
// message and consumers will see it. It identifies one publish attempt, not a
// message: re-publishing a message gives it a new value (an existing value in
// the caller's headers is overwritten). Do not use it for deduplication of
// logical messages; use amqp.Publishing.MessageId for that.
const PublishIDHeader = "rabbitretry-publish-id"

// Sentinel errors returned (wrapped) by ConfirmPublisher. Test with errors.Is.
var (
	// ErrUnroutable means the broker returned the message with basic.return
	// because it was published with mandatory=true and no queue was bound
	// that matched the exchange and routing key (RabbitMQ "Publishers" guide,
	// "Unroutable Message Handling"). The message was NOT enqueued anywhere.
	// The wrapping error names the exchange, routing key and the broker's
	// reply code and text (typically 312 NO_ROUTE).
	ErrUnroutable = errors.New("amqpretry: message unroutable (returned by broker)")

	// ErrNacked means the broker answered the publish with basic.nack
	// (RabbitMQ "Consumer Acknowledgements and Publisher Confirms": a nack is
	// sent when the broker could not take responsibility for the message, e.g.
	// a queue with x-overflow=reject-publish is full, or an internal error in
	// the queue process). The message must be treated as not published.
	ErrNacked = errors.New("amqpretry: publish nacked by broker")

	// ErrConfirmTimeout means no publisher confirm (basic.ack / basic.nack)
	// arrived within PublisherConfig.ConfirmTimeout after the message was
	// written to the channel. The message may or may not have been enqueued;
	// callers must treat it as failed (e.g. not ack the message they were
	// forwarding) and may republish, accepting a possible duplicate.
	ErrConfirmTimeout = errors.New("amqpretry: timed out waiting for publisher confirm")

	// ErrClosed is returned by every ConfirmPublisher method called after
	// Close, and (wrapped together with ErrChannelClosed) for publishes that
	// were still waiting for a confirm when Close gave up waiting.
	ErrClosed = errors.New("amqpretry: publisher closed")

	// ErrChannelClosed means the AMQP channel (or its connection) closed after
	// the message was written but before its confirm arrived: for instance the
	// broker closed the channel with 404 NOT_FOUND because the exchange does
	// not exist, the connection was lost, or the broker was restarted. The
	// outcome is unknown (the message may or may not have been routed), so
	// callers must treat the publish as failed and not ack the original. When
	// the broker sent a reason, the error also wraps the *amqp.Error (use
	// errors.As to get its Code, e.g. 404). Other publishes in flight on the
	// same channel fail with this error too; the channel is reopened
	// automatically on the next publish.
	ErrChannelClosed = errors.New("amqpretry: channel closed before publish was confirmed")
)

const (
	defaultPublisherChannels       = 2
	maxPublisherChannels           = 64
	defaultPublisherConfirmTimeout = 30 * time.Second

	// reopenAttempts bounds how often one publish tries to (re)open a channel
	// (and, if needed, redial the connection) before returning the error.
	reopenAttempts        = 5
	reopenInitialInterval = 100 * time.Millisecond
	reopenMaxInterval     = time.Second

	publisherConnectionName = "rabbitretry-confirm-publisher"

	// connectionCloseTimeout bounds the connection.close handshake in Close.
	connectionCloseTimeout = 5 * time.Second
)

// PublisherConfig configures a ConfirmPublisher. Zero values are replaced by
// the defaults documented on each field (see setDefaults); Validate reports
// the first invalid field by name.
type PublisherConfig struct {
	// URI is the AMQP URI of the broker, e.g.
	// "amqp://guest:guest@127.0.0.1:5672/". Required unless Dial is set.
	URI string

	// Dial, when set, is used instead of URI to open every connection
	// (the initial one and redials after the connection was lost). The
	// returned connection is owned by the publisher and closed by Close.
	// It must NOT have amqp.Config.Recovery enabled: ConfirmPublisher does its
	// own reconnection and relies on channels staying closed once closed.
	Dial func() (*amqp.Connection, error)

	// Channels is the number of AMQP channels, each in confirm mode, that
	// publishes are spread over round-robin. Default 2; valid range 1..64.
	Channels int

	// ConfirmTimeout is how long a publish waits for the broker's confirm
	// after writing the message before returning ErrConfirmTimeout; for
	// PublishRawBatch it is measured from the last write of the batch. It also
	// bounds how long Close waits for in-flight publishes. Default 30s; must
	// be > 0.
	ConfirmTimeout time.Duration

	// Logger receives connection/channel lifecycle events. Default
	// watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
}

// setDefaults fills zero fields with their defaults: Channels=2,
// ConfirmTimeout=30s, Logger=watermill.NopLogger{}.
func (c *PublisherConfig) setDefaults() {
	if c.Channels == 0 {
		c.Channels = defaultPublisherChannels
	}
	if c.ConfirmTimeout == 0 {
		c.ConfirmTimeout = defaultPublisherConfirmTimeout
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate returns an error naming the first invalid field: URI missing (and
// Dial nil) or not a valid AMQP URI, Channels outside 1..64, ConfirmTimeout
// <= 0, or Logger nil. Call it after defaults were applied (NewConfirmPublisher
// does both).
func (c PublisherConfig) Validate() error {
	if c.Dial == nil {
		if c.URI == "" {
			return errors.New("amqpretry: PublisherConfig.URI is required when Dial is nil")
		}
		if _, err := amqp.ParseURI(c.URI); err != nil {
			return fmt.Errorf("amqpretry: PublisherConfig.URI is invalid: %w", err)
		}
	}
	if c.Channels < 1 || c.Channels > maxPublisherChannels {
		return fmt.Errorf("amqpretry: PublisherConfig.Channels must be in 1..%d, got %d", maxPublisherChannels, c.Channels)
	}
	if c.ConfirmTimeout <= 0 {
		return fmt.Errorf("amqpretry: PublisherConfig.ConfirmTimeout must be > 0, got %s", c.ConfirmTimeout)
	}
	if c.Logger == nil {
		return errors.New("amqpretry: PublisherConfig.Logger must not be nil")
	}
	return nil
}

// ConfirmPublisher publishes with RabbitMQ publisher confirms and
// mandatory=true, and reports per message whether the broker took
// responsibility for it (RabbitMQ guides "Consumer Acknowledgements and
// Publisher Confirms" and "Publishers").
//
// It is safe for concurrent use by many goroutines. Publishes are pipelined:
// on each of the PublisherConfig.Channels channels many messages can be
// awaiting their confirm at once; a per-channel lock is held only while a
// message is written, never while waiting for its confirm.
//
// If a channel or the connection closes (channel error such as 404 on a
// missing exchange, network failure, broker restart), publishes waiting on it
// fail with ErrChannelClosed and the next publish transparently reopens the
// channel and, if needed, redials the connection (a few attempts with
// exponential backoff, 100ms..1s). No action is required by the caller.
//
// Every published message gets the PublishIDHeader header.
type ConfirmPublisher struct {
	cfg      PublisherConfig
	logger   watermill.LoggerAdapter
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
	conn   *amqp.Connection

	slots []*pubSlot
	next  atomic.Uint64
}

// NewConfirmPublisher applies defaults to cfg, validates it, dials the broker
// and opens cfg.Channels channels in confirm mode. It returns the Validate
// error for a bad config, or the dial/channel error if the broker is
// unreachable (no retry at construction time).
func NewConfirmPublisher(cfg PublisherConfig) (*ConfirmPublisher, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var rnd [6]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return nil, fmt.Errorf("amqpretry: generating publisher instance id: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &ConfirmPublisher{
		cfg:      cfg,
		logger:   cfg.Logger,
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
		return nil, err
	}
	for _, s := range p.slots {
		st, err := s.open()
		if err != nil {
			_ = p.Close()
			return nil, fmt.Errorf("amqpretry: opening publisher channel %d: %w", s.index, err)
		}
		s.state.Store(st)
	}
	return p, nil
}

// begin registers an in-flight operation; it returns ErrClosed after Close.
func (p *ConfirmPublisher) begin() error {
	p.lifeMu.RLock()
	defer p.lifeMu.RUnlock()
	if p.closed {
		return ErrClosed
	}
	p.inflight.Add(1)
	return nil
}

func (p *ConfirmPublisher) isClosed() bool {
	p.lifeMu.RLock()
	defer p.lifeMu.RUnlock()
	return p.closed
}

// connection returns the current connection, dialling a new one if there is
// none or it is closed.
func (p *ConfirmPublisher) connection() (*amqp.Connection, error) {
	p.dialMu.Lock()
	defer p.dialMu.Unlock()

	p.connMu.Lock()
	c := p.conn
	p.connMu.Unlock()
	if c != nil && !c.IsClosed() {
		return c, nil
	}
	if p.isClosed() {
		return nil, ErrClosed
	}

	var err error
	if p.cfg.Dial != nil {
		c, err = p.cfg.Dial()
		if err == nil && c == nil {
			err = errors.New("PublisherConfig.Dial returned a nil connection")
		}
	} else {
		props := amqp.NewConnectionProperties()
		props.SetClientConnectionName(publisherConnectionName)
		c, err = amqp.DialConfig(p.cfg.URI, amqp.Config{Properties: props})
	}
	if err != nil {
		return nil, fmt.Errorf("amqpretry: dialling broker: %w", err)
	}

	p.connMu.Lock()
	if p.isClosed() {
		p.connMu.Unlock()
		_ = c.Close()
		return nil, ErrClosed
	}
	p.conn = c
	p.connMu.Unlock()

	closes := c.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		if e, ok := <-closes; ok && e != nil {
			p.logger.Error("AMQP publisher connection closed; will redial on next publish", e, nil)
		}
	}()
	p.logger.Info("AMQP publisher connection opened", nil)
	return c, nil
}

// Channel opens a fresh, plain (non-confirm) channel on the publisher's
// connection, redialling first if the connection is closed. It is meant for
// topology declarations by other code; the caller must Close it. Channel
// errors on it (e.g. a failed passive declare) do not affect publishing.
// Returns ErrClosed after Close, or the dial/channel.open error.
func (p *ConfirmPublisher) Channel() (*amqp.Channel, error) {
	if err := p.begin(); err != nil {
		return nil, err
	}
	defer p.inflight.Done()
	c, err := p.connection()
	if err != nil {
		return nil, err
	}
	ch, err := c.Channel()
	if err != nil {
		return nil, fmt.Errorf("amqpretry: opening channel: %w", err)
	}
	return ch, nil
}

// PublishRaw publishes msg to exchange with routing key key and
// mandatory=true on a confirm-mode channel, and returns nil only after the
// broker confirmed it with basic.ack and did not return it with basic.return
// (per the RabbitMQ "Publishers" and "Consumer Acknowledgements and Publisher
// Confirms" guides, a returned mandatory message is still acked, and the
// return is sent before the ack). The PublishIDHeader header is added to a
// copy of msg.Headers; msg itself is not modified.
//
// Errors (test with errors.Is / errors.As):
//   - ErrUnroutable: the broker returned the message (no queue matched);
//     the error text names exchange, key and the broker's reply.
//   - ErrNacked: the broker answered with basic.nack.
//   - ErrConfirmTimeout: no confirm within PublisherConfig.ConfirmTimeout.
//   - ErrChannelClosed (possibly wrapping *amqp.Error, e.g. code 404 for a
//     missing exchange): the channel/connection closed before the confirm.
//   - ctx.Err() (wrapped) if ctx ends before the confirm arrived.
//   - ErrClosed after Close; a dial/channel error if the channel could not
//     be (re)opened after a few attempts; an amqp error for invalid headers.
//
// For every error other than ErrClosed and errors returned before anything
// was written, the message may or may not have been enqueued; treat it as
// failed.
func (p *ConfirmPublisher) PublishRaw(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
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
	w, err := s.publish(ctx, exchange, key, prepared)
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
// write. It returns nil if every message was confirmed and none returned,
// otherwise errors.Join of one error per failed message, each prefixed with
// the message's index in msgs (errors.Is works on the joined error). If
// writing stops early (ctx done, channel cannot be reopened, ErrClosed),
// the unwritten messages fail with that error. An empty msgs returns nil.
func (p *ConfirmPublisher) PublishRawBatch(ctx context.Context, exchange, key string, msgs []amqp.Publishing) error {
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
	waiters := make([]*waiter, len(msgs))
	errs := make([]error, len(msgs))
	for i := range msgs {
		prepared, err := prepareMessage(msgs[i])
		if err != nil {
			errs[i] = err // specific to this message; go on with the rest
			continue
		}
		w, err := s.publish(ctx, exchange, key, prepared)
		if err != nil {
			// ctx done, ErrClosed, or the channel could not be reopened:
			// do not retry (and reopen) for every remaining message.
			for j := i; j < len(msgs); j++ {
				if errs[j] == nil {
					errs[j] = err
				}
			}
			break
		}
		waiters[i] = w
	}

	timer := time.NewTimer(p.cfg.ConfirmTimeout)
	defer timer.Stop()
	timedOut := false
	for i, w := range waiters {
		if w == nil {
			continue
		}
		if timedOut {
			errs[i] = w.expire()
			continue
		}
		err := w.wait(ctx, timer.C)
		if errors.Is(err, ErrConfirmTimeout) {
			timedOut = true
		}
		errs[i] = err
	}

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
		return msg, fmt.Errorf("amqpretry: invalid message headers: %w", err)
	}
	msg.Headers = headers
	return msg, nil
}

// Close stops accepting publishes (new calls return ErrClosed), waits up to
// ConfirmTimeout for in-flight publishes to get their confirms, then closes
// the connection and with it all channels (the connection.close handshake is
// bounded by 5s). Publishes still waiting after that fail with both
// ErrChannelClosed and ErrClosed. Close is idempotent; later calls return the
// first call's result. An already-lost connection is not an error; a failed
// close handshake is returned wrapped.
func (p *ConfirmPublisher) Close() error {
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
			p.logger.Info("ConfirmPublisher.Close: in-flight publishes did not finish within ConfirmTimeout; closing anyway", nil)
		}
		timer.Stop()

		p.connMu.Lock()
		c := p.conn
		p.conn = nil
		p.connMu.Unlock()
		if c != nil && !c.IsClosed() {
			if err := c.CloseDeadline(time.Now().Add(connectionCloseTimeout)); err != nil && !errors.Is(err, amqp.ErrClosed) {
				p.closeErr = fmt.Errorf("amqpretry: closing publisher connection: %w", err)
			}
		}
		// Channels die with the connection; the per-channel goroutines fail
		// any waiter left and exit.
	})
	return p.closeErr
}

func (p *ConfirmPublisher) pickSlot() *pubSlot {
	n := uint64(len(p.slots))
	return p.slots[(p.next.Add(1)-1)%n]
}

// pubSlot is one of the publisher's channel positions. The AMQP channel in it
// is replaced when it dies.
type pubSlot struct {
	p     *ConfirmPublisher
	index int

	// sem is the per-channel publish lock (a 1-buffered channel so waiting
	// for it honours ctx). It serialises GetNextPublishSeqNo + registration +
	// basic.publish, and channel reopening.
	sem   chan struct{}
	seq   uint64 // guarded by sem
	state atomic.Pointer[chanState]
}

// open opens a new confirm-mode channel and starts its dispatcher goroutine.
func (s *pubSlot) open() (*chanState, error) {
	c, err := s.p.connection()
	if err != nil {
		return nil, err
	}
	ch, err := c.Channel()
	if err != nil {
		return nil, fmt.Errorf("amqpretry: opening channel: %w", err)
	}
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("amqpretry: enabling publisher confirms: %w", err)
	}
	// Unbuffered on purpose: amqp091-go delivers basic.return and the
	// confirms (basic.ack/nack, one Confirmation per tag even for
	// multiple=true) from the connection's single reader goroutine in frame
	// order, and blocks until we receive. Since RabbitMQ sends the return of
	// a mandatory message before its ack, receiving both on unbuffered
	// channels in one goroutine guarantees we see the return first.
	// amqp091-go drops a notification a listener has not taken within 5s;
	// run never blocks (waiter.done is buffered), so that cannot happen, and
	// if it did the waiter would end with ErrConfirmTimeout, not a wrong
	// result.
	st := &chanState{
		slot:     s,
		ch:       ch,
		returns:  ch.NotifyReturn(make(chan amqp.Return)),
		confirms: ch.NotifyPublish(make(chan amqp.Confirmation)),
		closes:   closes,
		pending:  make(map[uint64]*waiter),
		ids:      make(map[string]uint64),
	}
	go st.run()
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
	if st := s.state.Load(); st != nil && !st.isClosed() && !st.ch.IsClosed() {
		return st, nil
	}
	if s.p.isClosed() {
		return nil, ErrClosed
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
		if errors.Is(err, ErrClosed) {
			return nil, backoff.Permanent(err)
		}
		return st, err
	}, b, func(err error, d time.Duration) {
		s.p.logger.Error("Reopening AMQP publisher channel failed, retrying", err,
			watermill.LogFields{"channel": s.index, "retry_in": d.String()})
	})
	if err != nil {
		if s.p.isClosed() {
			return nil, ErrClosed
		}
		if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
			err = fmt.Errorf("%w (last error: %w)", ctxErr, err)
		}
		return nil, fmt.Errorf("amqpretry: reopening publisher channel %d: %w", s.index, err)
	}
	s.state.Store(st)
	s.p.logger.Info("AMQP publisher channel (re)opened", watermill.LogFields{"channel": s.index})
	return st, nil
}

// publish writes one message (prepared by prepareMessage, so its Headers map
// is private and writable) and returns a waiter for its confirm.
func (s *pubSlot) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) (*waiter, error) {
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

		s.seq++
		id := s.p.instance + "-" + strconv.Itoa(s.index) + "-" + strconv.FormatUint(s.seq, 10)
		msg.Headers[PublishIDHeader] = id
		tag := st.ch.GetNextPublishSeqNo()
		w := &waiter{st: st, tag: tag, id: id, exchange: exchange, key: key, done: make(chan error, 1)}
		if !st.register(w) {
			lastErr = ErrChannelClosed
			continue // channel died meanwhile: reopen and retry
		}
		err = st.ch.PublishWithContext(ctx, exchange, key, true, false, msg)
		if err == nil {
			return w, nil
		}
		// Nothing was sent for this tag (amqp091-go rolls its counter back),
		// so drop the registration before the tag can be reused.
		st.unregister(w)
		if errors.Is(err, amqp.ErrClosed) {
			// Channel closed before the write: the message was not sent,
			// retrying on a fresh channel is safe.
			lastErr = err
			continue
		}
		return nil, fmt.Errorf("amqpretry: publishing to exchange %q with routing key %q: %w", exchange, key, err)
	}
	return nil, fmt.Errorf("amqpretry: publishing to exchange %q with routing key %q: channel kept closing: %w", exchange, key, lastErr)
}

// chanState is one incarnation of an AMQP channel with its pending confirms.
type chanState struct {
	slot     *pubSlot
	ch       *amqp.Channel
	returns  chan amqp.Return
	confirms chan amqp.Confirmation
	closes   chan *amqp.Error

	mu      sync.Mutex
	closed  bool
	pending map[uint64]*waiter // delivery tag -> waiter
	ids     map[string]uint64  // publish id -> delivery tag
}

func (st *chanState) isClosed() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.closed
}

// register adds w to the pending maps; false if the channel already closed.
func (st *chanState) register(w *waiter) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.closed {
		return false
	}
	st.pending[w.tag] = w
	st.ids[w.id] = w.tag
	return true
}

// unregister removes w if it is still pending (timeout, ctx, failed write).
func (st *chanState) unregister(w *waiter) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.pending[w.tag] == w {
		delete(st.pending, w.tag)
	}
	if tag, ok := st.ids[w.id]; ok && tag == w.tag {
		delete(st.ids, w.id)
	}
}

// run is the single dispatcher for this channel. It handles each return and
// confirmation completely before receiving the next one, so a basic.return
// (always delivered before the basic.ack of the same message) is recorded
// before that message's confirmation is resolved.
func (st *chanState) run() {
	for {
		select {
		case r, ok := <-st.returns:
			if !ok {
				st.shutdown(st.pollCloseErr())
				return
			}
			st.handleReturn(r)
		case c, ok := <-st.confirms:
			if !ok {
				st.shutdown(st.pollCloseErr())
				return
			}
			st.handleConfirm(c)
		case e, ok := <-st.closes:
			var err *amqp.Error
			if ok {
				err = e
			}
			st.shutdown(err)
			return
		}
	}
}

// pollCloseErr fetches the close reason if amqp091-go already queued it
// (it sends it before closing the notification channels).
func (st *chanState) pollCloseErr() *amqp.Error {
	select {
	case e := <-st.closes:
		return e
	default:
		return nil
	}
}

func (st *chanState) handleReturn(r amqp.Return) {
	id, _ := r.Headers[PublishIDHeader].(string)
	st.mu.Lock()
	tag, ok := st.ids[id]
	if ok {
		delete(st.ids, id)
		if w := st.pending[tag]; w != nil {
			w.returned = true
			w.replyCode = r.ReplyCode
			w.replyText = r.ReplyText
		}
	}
	st.mu.Unlock()
	if !ok {
		st.slot.p.logger.Debug("basic.return for unknown or abandoned publish", watermill.LogFields{
			"publish_id": id, "exchange": r.Exchange, "routing_key": r.RoutingKey,
		})
	}
}

func (st *chanState) handleConfirm(c amqp.Confirmation) {
	st.mu.Lock()
	w := st.pending[c.DeliveryTag]
	if w != nil {
		delete(st.pending, c.DeliveryTag)
		if tag, ok := st.ids[w.id]; ok && tag == c.DeliveryTag {
			delete(st.ids, w.id)
		}
	}
	st.mu.Unlock()
	if w == nil {
		return // abandoned (timeout / ctx) or a tag we never registered
	}
	var err error
	switch {
	case w.returned:
		err = fmt.Errorf("%w: exchange %q, routing key %q: %d %s",
			ErrUnroutable, w.exchange, w.key, w.replyCode, w.replyText)
	case !c.Ack:
		err = fmt.Errorf("%w: exchange %q, routing key %q", ErrNacked, w.exchange, w.key)
	}
	w.done <- err // buffered 1, and w was removed from pending: never blocks
}

// shutdown fails every pending waiter and marks the state closed so the next
// publish on this slot reopens a channel.
func (st *chanState) shutdown(reason *amqp.Error) {
	st.mu.Lock()
	st.closed = true
	pending := st.pending
	st.pending = make(map[uint64]*waiter)
	st.ids = make(map[string]uint64)
	st.mu.Unlock()

	var cause error
	switch {
	case reason != nil:
		cause = fmt.Errorf("%w: %w", ErrChannelClosed, reason)
		st.slot.p.logger.Error("AMQP publisher channel closed", reason,
			watermill.LogFields{"channel": st.slot.index, "pending": len(pending)})
	case st.slot.p.isClosed():
		cause = fmt.Errorf("%w: %w", ErrChannelClosed, ErrClosed)
	default:
		cause = ErrChannelClosed
	}
	for _, w := range pending {
		w.done <- fmt.Errorf("amqpretry: exchange %q, routing key %q: %w", w.exchange, w.key, cause)
	}
	// Normally a no-op (the channel is already closed); releases the channel
	// if a misconfigured connection with automatic recovery revived it.
	_ = st.ch.Close()
}

// waiter is one publish awaiting its confirm. returned/replyCode/replyText
// are guarded by st.mu; done receives exactly one result.
type waiter struct {
	st       *chanState
	tag      uint64
	id       string
	exchange string
	key      string

	returned  bool
	replyCode uint16
	replyText string

	done chan error
}

// wait blocks until the confirm, ctx end, or timeout.
func (w *waiter) wait(ctx context.Context, timeout <-chan time.Time) error {
	select {
	case err := <-w.done:
		return err
	case <-timeout:
		return w.expire()
	case <-ctx.Done():
		w.st.unregister(w)
		select {
		case err := <-w.done:
			return err
		default:
		}
		return fmt.Errorf("amqpretry: waiting for publisher confirm (exchange %q, routing key %q): %w", w.exchange, w.key, ctx.Err())
	}
}

// expire abandons w after a confirm timeout, unless its result arrived.
func (w *waiter) expire() error {
	w.st.unregister(w)
	select {
	case err := <-w.done:
		return err
	default:
	}
	return fmt.Errorf("%w: exchange %q, routing key %q, delivery tag %d", ErrConfirmTimeout, w.exchange, w.key, w.tag)
}
