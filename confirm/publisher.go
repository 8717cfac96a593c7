package confirm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// PublishIDHeader is the AMQP header that Publisher adds to every
// message it publishes. Its value is a string "<instance>-<channel-index>-<seq>"
// that is unique per publish attempt within one Publisher (the
// <instance> part is random per Publisher, so values from different
// publishers practically never collide).
//
// The header exists so that a basic.return (which carries the returned
// message's properties but no delivery tag) can be matched to the publish it
// belongs to; see the RabbitMQ "Publishers" guide, section on unroutable
// messages and the mandatory flag.
//
// The broker cannot strip headers, so the header stays on the delivered
// message and consumers will see it. It identifies one publish attempt, not a
// message: re-publishing a message gives it a new value (an existing value in
// the caller's headers is overwritten). Do not use it for deduplication of
// logical messages; use amqp.Publishing.MessageId for that.
const PublishIDHeader = "rabbitretry-publish-id"

// DefaultConnectionName is the client-provided connection name
// (client property connection_name; RabbitMQ "Connections" guide,
// "Client-Provided Connection Name": shown by rabbitmqctl list_connections
// and the management UI) of the publisher's connections unless
// Config.ConnectionName sets another.
const DefaultConnectionName = "rabbitretry-confirm-publisher"

// Sentinel errors returned (wrapped) by Publisher. Test with errors.Is.
var (
	// ErrUnroutable means the broker returned the message with basic.return
	// because it was published with mandatory=true and no queue was bound
	// that matched the exchange and routing key (RabbitMQ "Publishers" guide,
	// "Unroutable Message Handling"). The message was NOT enqueued anywhere.
	// The wrapping error names the exchange, routing key and the broker's
	// reply code and text (typically 312 NO_ROUTE).
	ErrUnroutable = errors.New("confirm: message unroutable (returned by broker)")

	// ErrNacked means the broker answered the publish with basic.nack
	// (RabbitMQ "Consumer Acknowledgements and Publisher Confirms": a nack is
	// sent when the broker could not take responsibility for the message, e.g.
	// a queue with x-overflow=reject-publish is full, or an internal error in
	// the queue process). The message must be treated as not published.
	ErrNacked = errors.New("confirm: publish nacked by broker")

	// ErrConfirmTimeout means no publisher confirm (basic.ack / basic.nack)
	// arrived within Config.ConfirmTimeout after the message was
	// written to the channel. The message may or may not have been enqueued;
	// callers must treat it as failed (e.g. not ack the message they were
	// forwarding) and may republish, accepting a possible duplicate.
	ErrConfirmTimeout = errors.New("confirm: timed out waiting for publisher confirm")

	// ErrClosed is returned by every Publisher method called after
	// Close, and (wrapped together with ErrChannelClosed) for publishes that
	// were still waiting for a confirm when Close gave up waiting.
	ErrClosed = errors.New("confirm: publisher closed")

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
	ErrChannelClosed = errors.New("confirm: channel closed before publish was confirmed")

	// ErrBlocked means the broker is blocking this publisher's connection
	// (RabbitMQ "Blocked Connection Notifications" and "Memory and Disk
	// Alarms": while a memory or disk alarm is in effect the broker sends
	// connection.blocked to a connection that publishes and stops reading
	// from it until connection.unblocked). While the connection is blocked a
	// publish fails at once with ErrBlocked and nothing is written, so the
	// message was NOT published; Channel fails the same way. A publish that
	// was already written when the block arrived waits up to 1 s more for its
	// confirm (messages the broker read before blocking are confirmed), then
	// fails with ErrBlocked too; its outcome is then unknown (the broker may
	// enqueue it once it unblocks), as with ErrConfirmTimeout. The wrapping
	// error carries the broker's reason, e.g. "low on memory".
	ErrBlocked = errors.New("confirm: broker is blocking publishers (connection.blocked)")

	// ErrWriteTimeout means writing the message to the connection's socket
	// did not finish within Config.ConfirmTimeout (at least 1 s; the
	// deadline applies to each write of a frame): the broker stopped
	// reading (flow control, see ErrBlocked) or the network stalled. The
	// connection is closed (amqp091-go closes it on a write error), so the
	// partly written message is discarded by the broker; every other publish
	// in flight on the connection fails with ErrChannelClosed, and the next
	// publish redials. Only connections the publisher dials itself (URI /
	// AmqpConfig, not Config.Dial) have this write deadline.
	ErrWriteTimeout = errors.New("confirm: writing the message to the broker timed out")
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

	// connectionCloseTimeout bounds the connection.close handshake in Close.
	connectionCloseTimeout = 5 * time.Second

	// defaultDialTimeout is amqp091-go's TCP dial and handshake timeout
	// (DialConfig), used unless the URI has connection_timeout or
	// AmqpConfig.Dial is set.
	defaultDialTimeout = 30 * time.Second

	// maxInFlightPerChannel bounds the publishes awaiting their confirm on
	// one channel; the channel's basic.return buffer has as many slots, so
	// amqp091-go never has to wait for (or drop, after 5 s) a return.
	maxInFlightPerChannel = 512

	// blockedGrace is how long a publish written before its connection got
	// blocked still waits for its confirm.
	blockedGrace = time.Second

	// logQueueSize bounds the log entries waiting for the user's logger.
	logQueueSize = 256

	// minIOTimeout is the floor of the socket write deadline and of the
	// channel.open bound (ConfirmTimeout otherwise): shorter ones would drop
	// healthy connections on ordinary hiccups.
	minIOTimeout = time.Second
)

// Config configures a Publisher. Zero values are replaced by
// the defaults documented on each field (see setDefaults); Validate reports
// the first invalid field by name.
type Config struct {
	// URI is the AMQP URI of the broker, e.g.
	// "amqp://guest:guest@127.0.0.1:5672/"; amqps:// for TLS (RabbitMQ
	// "TLS Support"), with the optional query parameters amqp091-go parses
	// (heartbeat, connection_timeout in ms, channel_max, ...). Required unless
	// Dial is set.
	URI string

	// AmqpConfig, when set, is the amqp091-go configuration every connection
	// to URI is dialled with (amqp.DialConfig): TLSClientConfig, Heartbeat,
	// Dial (the TCP dialer, e.g. amqp.DefaultDial(5*time.Second) for a dial
	// timeout), Vhost, SASL, ChannelMax, FrameSize, Locale and Properties. It
	// is not modified (Properties and TLSClientConfig are copied per dial).
	// The connection_name property is always ConnectionName. Recovery must be
	// nil: Publisher reconnects itself and relies on channels staying
	// closed once closed. Default nil: amqp091-go's defaults (heartbeat 10 s,
	// 30 s dial timeout, TLS config from an amqps URI). amqpretry.New passes
	// the subscriber's watermill-amqp Connection settings here.
	AmqpConfig *amqp.Config

	// ConnectionName is the client-provided connection name of the
	// publisher's connections (RabbitMQ "Connections", client-provided
	// connection name). Default DefaultConnectionName. Not used with
	// Dial.
	ConnectionName string

	// Dial, when set, is used instead of URI and AmqpConfig to open every
	// connection (the initial one and redials after the connection was
	// lost). The returned connection is owned by the publisher and closed by
	// Close. It must NOT have amqp.Config.Recovery enabled: Publisher
	// does its own reconnection and relies on channels staying closed once
	// closed. Writes on such a connection have no deadline (see
	// ErrWriteTimeout): prefer AmqpConfig.Dial for a custom TCP dialer.
	Dial func() (*amqp.Connection, error)

	// Channels is the number of AMQP channels, each in confirm mode, that
	// publishes are spread over round-robin. Default 2; valid range 1..64.
	Channels int

	// ConfirmTimeout is how long a publish waits for the broker's confirm
	// after writing the message before returning ErrConfirmTimeout; for
	// PublishRawBatch it is measured from the last write of the batch. It
	// also bounds every socket write of the connections the publisher dials
	// itself (ErrWriteTimeout) and every channel.open, but never below 1 s,
	// and how long Close waits for in-flight publishes. Default 30s; must be
	// > 0.
	ConfirmTimeout time.Duration

	// maxInFlight overrides maxInFlightPerChannel (tests).
	maxInFlight int

	// Logger receives connection, channel and flow-control events. It is
	// called from one goroutine of the publisher's own, never while a
	// publish or a confirm is being handled, so a slow logger cannot delay
	// or change a publish's result; when 256 entries are waiting for it,
	// further ones are dropped (and counted in the next entry). Default
	// watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
}

// setDefaults fills zero fields with their defaults: Channels=2,
// ConfirmTimeout=30s, ConnectionName=DefaultConnectionName,
// Logger=watermill.NopLogger{}.
func (c *Config) setDefaults() {
	if c.Channels == 0 {
		c.Channels = defaultPublisherChannels
	}
	if c.ConfirmTimeout == 0 {
		c.ConfirmTimeout = defaultPublisherConfirmTimeout
	}
	if c.ConnectionName == "" {
		c.ConnectionName = DefaultConnectionName
	}
	if c.maxInFlight == 0 {
		c.maxInFlight = maxInFlightPerChannel
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate returns an error naming the first invalid field: URI missing (and
// Dial nil) or not a valid AMQP URI, both Dial and AmqpConfig set,
// AmqpConfig.Recovery set, Channels outside 1..64, ConfirmTimeout <= 0, or
// Logger nil. Call it after defaults were applied (New does
// both).
func (c Config) Validate() error {
	if c.Dial == nil {
		if c.URI == "" {
			return errors.New("confirm: Config.URI is required when Dial is nil")
		}
		if _, err := amqp.ParseURI(c.URI); err != nil {
			return fmt.Errorf("confirm: Config.URI is invalid: %w", redact.Error(err, c.URI))
		}
	} else if c.AmqpConfig != nil {
		return errors.New("confirm: Config.AmqpConfig is not used with Dial; set one of them")
	}
	if c.AmqpConfig != nil && c.AmqpConfig.Recovery != nil {
		return errors.New("confirm: Config.AmqpConfig.Recovery must be nil (the publisher reconnects itself)")
	}
	if c.Channels < 1 || c.Channels > maxPublisherChannels {
		return fmt.Errorf("confirm: Config.Channels must be in 1..%d, got %d", maxPublisherChannels, c.Channels)
	}
	if c.ConfirmTimeout <= 0 {
		return fmt.Errorf("confirm: Config.ConfirmTimeout must be > 0, got %s", c.ConfirmTimeout)
	}
	if c.Logger == nil {
		return errors.New("confirm: Config.Logger must not be nil")
	}
	return nil
}

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

// current returns the current connection if it is open, else nil.
func (p *Publisher) current() *pubConn {
	p.connMu.Lock()
	defer p.connMu.Unlock()
	if p.conn == nil || p.conn.c.IsClosed() {
		return nil
	}
	return p.conn
}

// connection returns the current connection, dialling a new one if there is
// none or it is closed.
func (p *Publisher) connection() (*pubConn, error) {
	p.dialMu.Lock()
	defer p.dialMu.Unlock()

	if pc := p.current(); pc != nil {
		return pc, nil
	}
	if p.isClosed() {
		return nil, ErrClosed
	}
	c, err := p.dial()
	if err != nil {
		return nil, fmt.Errorf("confirm: dialling broker: %w", err)
	}
	pc := &pubConn{c: c, blockedC: make(chan struct{})}
	// Listeners first, so no block notification is missed. Both are
	// buffered and their goroutines never call user code inline.
	blocks := c.NotifyBlocked(make(chan amqp.Blocking, 16))
	closes := c.NotifyClose(make(chan *amqp.Error, 1))

	p.connMu.Lock()
	if p.isClosed() {
		p.connMu.Unlock()
		_ = c.Close()
		return nil, ErrClosed
	}
	p.conn = pc
	p.connMu.Unlock()

	go pc.watchBlocked(blocks, p.log)
	go func() {
		if e, ok := <-closes; ok && e != nil {
			p.log.error("AMQP publisher connection closed; will redial on next publish", e, nil)
		}
	}()
	p.log.info("AMQP publisher connection opened", nil)
	return pc, nil
}

// dial opens one connection: Config.Dial, or URI with AmqpConfig
// (copied), the publisher's connection name, and a write deadline of
// ioTimeout on the socket.
func (p *Publisher) dial() (*amqp.Connection, error) {
	if p.cfg.Dial != nil {
		c, err := p.cfg.Dial()
		if err == nil && c == nil {
			err = errors.New("Config.Dial returned a nil connection")
		}
		return c, err
	}
	var ac amqp.Config
	if p.cfg.AmqpConfig != nil {
		ac = *p.cfg.AmqpConfig
	}
	ac.Recovery = nil
	if ac.Properties == nil {
		ac.Properties = amqp.NewConnectionProperties()
	} else {
		ac.Properties = maps.Clone(ac.Properties)
	}
	ac.Properties.SetClientConnectionName(p.cfg.ConnectionName)
	if ac.TLSClientConfig != nil {
		ac.TLSClientConfig = ac.TLSClientConfig.Clone()
	}
	netDial := ac.Dial
	if netDial == nil {
		timeout := defaultDialTimeout
		if u, err := amqp.ParseURI(p.cfg.URI); err == nil && u.ConnectionTimeout > 0 {
			timeout = time.Duration(u.ConnectionTimeout) * time.Millisecond
		}
		netDial = amqp.DefaultDial(timeout)
	}
	writeTimeout := p.ioTimeout()
	ac.Dial = func(network, addr string) (net.Conn, error) {
		c, err := netDial(network, addr)
		if err != nil {
			return nil, err
		}
		return &deadlineConn{Conn: c, timeout: writeTimeout}, nil
	}
	conn, err := amqp.DialConfig(p.cfg.URI, ac)
	return conn, redact.Error(err, p.cfg.URI)
}

// ioTimeout bounds socket writes and channel.open: ConfirmTimeout, at
// least minIOTimeout.
func (p *Publisher) ioTimeout() time.Duration { return max(p.cfg.ConfirmTimeout, minIOTimeout) }

// deadlineConn sets a write deadline before every write, so a write the
// peer does not read (a blocked broker, a stalled network) fails after
// timeout instead of holding amqp091-go's connection send lock forever.
type deadlineConn struct {
	net.Conn
	timeout time.Duration
}

func (c *deadlineConn) Write(b []byte) (int, error) {
	if err := c.Conn.SetWriteDeadline(time.Now().Add(c.timeout)); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}

// Blocked reports whether the broker currently blocks the publisher's
// connection with connection.blocked (RabbitMQ "Blocked Connection
// Notifications"; sent while a memory or disk alarm is in effect, once the
// connection publishes), and the broker's reason, e.g. "low on memory".
// While it does, publishes fail with ErrBlocked. False when there is no open
// connection.
func (p *Publisher) Blocked() (reason string, blocked bool) {
	pc := p.current()
	if pc == nil {
		return "", false
	}
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return pc.reason, pc.blocked
}

// Connection returns the publisher's current AMQP connection, dialling one
// first if there is none or it is closed (Config.Dial, or URI with
// AmqpConfig). Use it to read what the broker sent at connection start
// (Connection.Properties: "version", "product", capabilities) or the
// negotiated settings (Connection.Config). Do not open publishing channels on
// it; closing it is like a network failure: publishes in flight fail with
// ErrChannelClosed and the next publish redials. Returns ErrClosed after
// Close, or the dial error.
func (p *Publisher) Connection() (*amqp.Connection, error) {
	if err := p.begin(); err != nil {
		return nil, err
	}
	defer p.inflight.Done()
	pc, err := p.connection()
	if err != nil {
		return nil, err
	}
	return pc.c, nil
}

// Channel opens a fresh, plain (non-confirm) channel on the publisher's
// connection, redialling first if the connection is closed. It is meant for
// topology declarations by other code; the caller must Close it. Channel
// errors on it (e.g. a failed passive declare) do not affect publishing.
// Returns ErrClosed after Close, ErrBlocked (wrapped) while the broker blocks
// the connection (a channel.open would not be answered), or the
// dial/channel.open error; a channel.open not answered within ConfirmTimeout
// (at least 1 s) closes the connection and returns its error.
func (p *Publisher) Channel() (*amqp.Channel, error) {
	if err := p.begin(); err != nil {
		return nil, err
	}
	defer p.inflight.Done()
	pc, err := p.connection()
	if err != nil {
		return nil, err
	}
	if err := pc.blockedErr("opening a channel"); err != nil {
		return nil, err
	}
	var ch *amqp.Channel
	err = pc.bounded(p.ioTimeout(), func() (err error) {
		ch, err = pc.c.Channel()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("confirm: opening channel: %w", err)
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

// pubConn is one AMQP connection with its flow-control state.
type pubConn struct {
	c *amqp.Connection

	mu       sync.Mutex
	blocked  bool
	reason   string
	since    time.Time
	blockedC chan struct{} // closed while blocked; a fresh one while not
}

// watchBlocked records connection.blocked / connection.unblocked. It only
// updates state and queues log entries, so amqp091-go's reader never waits
// for it. It ends when the connection closes (amqp091-go closes blocks).
func (pc *pubConn) watchBlocked(blocks <-chan amqp.Blocking, log *asyncLog) {
	for b := range blocks {
		pc.mu.Lock()
		was, since := pc.blocked, pc.since
		switch {
		case b.Active && !pc.blocked:
			pc.blocked, pc.reason, pc.since = true, b.Reason, time.Now()
			close(pc.blockedC)
		case !b.Active && pc.blocked:
			pc.blocked, pc.reason = false, ""
			pc.blockedC = make(chan struct{})
		}
		pc.mu.Unlock()
		if b.Active && !was {
			log.error("Broker blocks publishers (connection.blocked); publishes fail with ErrBlocked until it unblocks",
				fmt.Errorf("%w: %s", ErrBlocked, b.Reason), watermill.LogFields{"reason": b.Reason})
		} else if !b.Active && was {
			log.info("Broker unblocked publishers (connection.unblocked)", watermill.LogFields{"blocked_for": time.Since(since).String()})
		}
	}
}

// blockState returns whether the connection is blocked and a channel that
// is closed while it is (already closed if it is now).
func (pc *pubConn) blockState() (<-chan struct{}, bool) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return pc.blockedC, pc.blocked
}

// blockedErr returns ErrBlocked wrapped with the broker's reason and what
// was refused, or nil if the connection is not blocked.
func (pc *pubConn) blockedErr(what string) error {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	if !pc.blocked {
		return nil
	}
	return fmt.Errorf("%w (reason %q, for %s): %s", ErrBlocked, pc.reason, time.Since(pc.since).Round(time.Millisecond), what)
}

// bounded runs an RPC (channel.open, confirm.select) on the connection; if
// it is not answered within timeout (a broker that stopped reading the
// socket, e.g. blocked by an alarm, never answers), it closes the connection
// so the RPC returns.
func (pc *pubConn) bounded(timeout time.Duration, rpc func() error) error {
	t := time.AfterFunc(timeout, func() { _ = pc.c.CloseDeadline(time.Now()) })
	defer t.Stop()
	return rpc()
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

// asyncLog hands log entries to the user's logger from one goroutine of its
// own, so no path of the publisher ever waits for the logger. When
// logQueueSize entries are waiting, new ones are dropped and counted.
type asyncLog struct {
	l       watermill.LoggerAdapter
	q       chan logEntry
	done    chan struct{}
	once    sync.Once
	dropped atomic.Int64
}

type logEntry struct {
	level  int // 0 debug, 1 info, 2 error
	msg    string
	err    error
	fields watermill.LogFields
}

func newAsyncLog(l watermill.LoggerAdapter) *asyncLog {
	a := &asyncLog{l: l, q: make(chan logEntry, logQueueSize), done: make(chan struct{})}
	go a.run()
	return a
}

func (a *asyncLog) run() {
	for {
		select {
		case e := <-a.q:
			a.emit(e)
		case <-a.done:
			for {
				select {
				case e := <-a.q:
					a.emit(e)
				default:
					return
				}
			}
		}
	}
}

func (a *asyncLog) emit(e logEntry) {
	if n := a.dropped.Swap(0); n > 0 {
		e.fields = e.fields.Add(watermill.LogFields{"log_entries_dropped": n})
	}
	switch e.level {
	case 0:
		a.l.Debug(e.msg, e.fields)
	case 1:
		a.l.Info(e.msg, e.fields)
	default:
		a.l.Error(e.msg, e.err, e.fields)
	}
}

func (a *asyncLog) put(e logEntry) {
	select {
	case a.q <- e:
	default:
		a.dropped.Add(1)
	}
}

func (a *asyncLog) debug(msg string, f watermill.LogFields) { a.put(logEntry{0, msg, nil, f}) }
func (a *asyncLog) info(msg string, f watermill.LogFields)  { a.put(logEntry{1, msg, nil, f}) }
func (a *asyncLog) error(msg string, err error, f watermill.LogFields) {
	a.put(logEntry{2, msg, err, f})
}

// stop lets the goroutine emit what is queued and end.
func (a *asyncLog) stop() { a.once.Do(func() { close(a.done) }) }
