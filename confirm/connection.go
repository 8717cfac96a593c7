package confirm

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

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
