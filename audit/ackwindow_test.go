package audit_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/memstore"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// ackConn is a Consumer's AMQP socket that calls onAck for each
// basic.ack frame (class 60, method 80) the client writes: after the
// frame left (before false), or instead of writing it (before true: the
// write fails, the ack never reaches the broker).
type ackConn struct {
	net.Conn
	before bool
	onAck  func()
	mu     sync.Mutex
	buf    []byte
	header bool
}

// acks parses the frames of p (AMQP 0-9-1 framing: type, channel, size,
// payload, 0xCE; the protocol header first) and counts the basic.acks.
func (c *ackConn) acks(p []byte) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.buf = append(c.buf, p...)
	if !c.header && len(c.buf) >= 8 && string(c.buf[:4]) == "AMQP" {
		c.buf, c.header = c.buf[8:], true
	}
	n := 0
	for len(c.buf) >= 7 {
		size := int(binary.BigEndian.Uint32(c.buf[3:7]))
		if len(c.buf) < 8+size {
			break
		}
		if f := c.buf[7 : 7+size]; c.buf[0] == 1 && size >= 4 && binary.BigEndian.Uint16(f) == 60 && binary.BigEndian.Uint16(f[2:]) == 80 {
			n++
		}
		c.buf = c.buf[8+size:]
	}
	return n
}

func (c *ackConn) Write(p []byte) (int, error) {
	n := c.acks(p)
	if c.before && n > 0 {
		c.onAck()
		return 0, errors.New("ackConn: died before the ack was written")
	}
	w, err := c.Conn.Write(p)
	for range n {
		c.onAck()
	}
	return w, err
}

// ackDial dials AMQP sockets that call onAck around each basic.ack.
func ackDial(before bool, onAck func()) *amqp.Config {
	return &amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
		c, err := net.DialTimeout(network, addr, 10*time.Second)
		if err != nil {
			return nil, err
		}
		return &ackConn{Conn: c, before: before, onAck: onAck}, nil
	}}
}

// deadLog is a delivery log whose process can die: after kill, every call
// fails and the Consumer's Run is cancelled (the process is gone; its
// connection closes).
type deadLog struct {
	storeLog
	selfOffer // of itself: the log of every call
	dead      atomic.Bool
	cancel    func()
}

var errDead = errors.New("deadLog: the process died")

func (s *deadLog) kill() {
	if !s.dead.Swap(true) {
		s.cancel()
	}
}

func (s *deadLog) check() error {
	if s.dead.Load() {
		return errDead
	}
	return nil
}

func (s *deadLog) Write(ctx context.Context, a []audit.Arrival, b []audit.Attempt) error {
	if err := s.check(); err != nil {
		return err
	}
	return s.storeLog.Write(ctx, a, b)
}

func (s *deadLog) WriteDeliveries(ctx context.Context, a []audit.Arrival, b []audit.Attempt, d []unackedDelivery) error {
	if err := s.check(); err != nil {
		return err
	}
	return s.storeLog.WriteDeliveries(ctx, a, b, d)
}

func (s *deadLog) UnackedDeliveries(ctx context.Context, fps []string) ([]unackedDelivery, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	return s.storeLog.UnackedDeliveries(ctx, fps)
}

func (s *deadLog) ClaimDelivery(ctx context.Context, id, from, to string) (bool, error) {
	if err := s.check(); err != nil {
		return false, err
	}
	return s.storeLog.ClaimDelivery(ctx, id, from, to)
}

func (s *deadLog) TakeAckingDelivery(ctx context.Context, id, session string) (bool, error) {
	if err := s.check(); err != nil {
		return false, err
	}
	return s.storeLog.TakeAckingDelivery(ctx, id, session)
}

func (s *deadLog) DeliveriesAcking(ctx context.Context, session string, ids []string) error {
	if err := s.check(); err != nil {
		return err
	}
	return s.storeLog.DeliveriesAcking(ctx, session, ids)
}

func (s *deadLog) DeliveriesNotAcked(ctx context.Context, session string, ids []string) error {
	if err := s.check(); err != nil {
		return err
	}
	return s.storeLog.DeliveriesNotAcked(ctx, session, ids)
}

// runUntilDead runs a Consumer into log with cfg until log is killed.
func runUntilDead(t *testing.T, e *brokerEnv, log *deadLog, amqpCfg *amqp.Config) {
	t.Helper()
	c, err := audit.NewConsumer(audit.ConsumerConfig{
		URI: e.uri, Store: log, Naming: e.naming, BatchWait: 20 * time.Millisecond, AmqpConfig: amqpCfg,
		Exchanges: []audit.Binding{{Exchange: e.exchange, RoutingKey: routingKey}},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	log.cancel = cancel
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		cancel()
		t.Fatal("the consumer never died")
	}
}

// publishSame publishes one identical message (same UUID header, body
// and timestamp second) to the business exchange, confirmed.
func (e *brokerEnv) publishSame() {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		e.t.Fatal(err)
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), e.exchange, routingKey, true, false, amqp.Publishing{
		Headers: amqp.Table{audit.DefaultUUIDHeader: "same"}, Body: []byte("same body"),
		Timestamp: time.Unix(1_700_000_000, 0), DeliveryMode: amqp.Persistent,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	if ok, err := dc.WaitContext(context.Background()); !ok || err != nil {
		e.t.Fatalf("publish not confirmed: %v %v", ok, err)
	}
}

// crashAroundAck: publish P1; a Consumer stores it and its process dies
// right after the ack of P1 left (afterAck) or right before (else). Then
// publish P2, identical content; a Consumer receives it and its process
// dies before P2's commit, so P2 is redelivered. A last Consumer gets the
// redeliveries. It returns the arrival records of the message.
func crashAroundAck(t *testing.T, afterAck bool) (records []audit.Arrival, accounted string) {
	e := newBrokerEnv(t)
	mem := memstore.New()
	c := audit.ConsumerConfig{URI: e.uri, Store: mem, Naming: e.naming, Exchanges: []audit.Binding{{Exchange: e.exchange, RoutingKey: routingKey}}}
	if dc, err := audit.NewConsumer(c); err != nil {
		t.Fatal(err)
	} else if err := dc.Declare(); err != nil {
		t.Fatal(err)
	}
	// 1. P1 stored; the process dies around its ack.
	e.publishSame()
	first := &deadLog{storeLog: joinLog(mem)}
	first.selfOffer = offerOf(first)
	runUntilDead(t, e, first, ackDial(!afterAck, first.kill))
	if a, _, _, _, _ := mem.Counts(); a != 1 {
		t.Fatalf("%d arrivals after the first consumer, want 1", a)
	}
	published := 1
	if afterAck {
		// 2. P2, identical, first delivered to a process that dies before
		// its commit.
		e.publishSame()
		published++
		second := &deadLog{storeLog: joinLog(mem)}
		second.selfOffer = offerOf(second)
		second.storeLog = &killBeforeWrite{storeLog: joinLog(mem), kill: second.kill}
		runUntilDead(t, e, second, nil)
	}
	testkit.WaitFor(t, 10*time.Second, "the unacked publishes back in the queue", func() bool { return e.ready(e.naming.ArrivalsQueue) == 1 })
	// 3. The redelivery goes to a healthy Consumer.
	var acks atomic.Int32
	cons, stop := e.consumer(mem, func(c *audit.ConsumerConfig) { c.AmqpConfig = ackDial(false, func() { acks.Add(1) }) })
	testkit.WaitFor(t, 10*time.Second, "the redelivery acked", func() bool { return acks.Load() >= 1 })
	stop()
	records = mem.Arrivals()["same"]
	flagged := 0
	for _, a := range records {
		if a.MaybeDuplicate {
			flagged++
		}
	}
	accounted = accountLine(t.Name(), published, len(records), max(0, len(records)-published), max(0, published-len(records)))
	unacked, acking := mem.Unacked()
	t.Logf("%s (flagged maybe_duplicate %d; records written by the last consumer %d; queue ready after %d; unacked-delivery rows left %d, acking %d)",
		accounted, flagged, cons.Stats().Arrivals, e.ready(e.naming.ArrivalsQueue), unacked, acking)
	return records, accounted
}

func accountLine(name string, published, handled, dups, lost int) string {
	return fmt.Sprintf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", name, published, handled, dups, lost)
}

// killBeforeWrite kills the process at its first write, before anything
// is committed.
type killBeforeWrite struct {
	storeLog
	kill func()
}

func (s *killBeforeWrite) WriteDeliveries(context.Context, []audit.Arrival, []audit.Attempt, []unackedDelivery) error {
	s.kill()
	return errDead
}

// The Consumer process dies right after the ack of a stored arrival left,
// before it could do anything else. Later an identical publish (same
// UUID, body, timestamp second) is delivered to a process that dies
// before its commit, and is redelivered: it is a publish never stored, so
// it must be stored (flagged maybe_duplicate at most), not taken for the
// first one: two publishes, two records, none lost.
func TestConsumerDiesAfterAckIdenticalRedelivery(t *testing.T) {
	records, _ := crashAroundAck(t, true)
	if len(records) != 2 {
		t.Fatalf("%d records of 2 identical publishes (the redelivered one lost to the first one's leftover row)", len(records))
	}
	if records[0].ID == records[1].ID {
		t.Fatal("two publishes under one ID")
	}
}

// The Consumer process dies right before the ack of a stored arrival
// left: it is redelivered and stored at most once more, flagged
// maybe_duplicate; never lost.
func TestConsumerDiesBeforeAck(t *testing.T) {
	records, _ := crashAroundAck(t, false)
	if len(records) == 0 {
		t.Fatal("the publish was lost")
	}
	plain := 0
	for _, a := range records {
		if !a.MaybeDuplicate {
			plain++
		}
	}
	if len(records) > 2 || plain != 1 {
		t.Fatalf("%d records, %d not flagged maybe_duplicate; want 1 or 2 with exactly one unflagged", len(records), plain)
	}
}
