package audit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

// batch is what one Store.Write carries, with the highest delivery tag of
// each channel it acks; committed is closed once Write returned nil.
type batch struct {
	arrivals []Arrival
	// With a delivery log, per arrival: its fingerprint, whether it was
	// redelivered, resolved (its ID final), claimed (a row of an ended
	// session had it: stored already).
	fps                            []string
	redelivered, resolved, claimed []bool
	attempts                       []Attempt
	arrTag, attTag                 uint64
	records, pending               int // records; deliveries (incl. malformed)
	committed                      chan struct{}
}

// session consumes until an error. With *quarantine set it starts with
// prefetch 1 and batches of 1 (after a delivery could not be decoded: only
// that message is held when it closes the connection again) and goes back
// to the configured prefetch and batch size, clearing *quarantine, once
// (Writers+1)×BatchSize deliveries went through.
//
// Cyclomatic complexity ~42, kept on purpose: after set-up, writers and
// acker moved to methods, what is left is the one select loop over the six
// event sources of a session (ctx, connection close, a writer's error, the
// batch timer, the two delivery channels) and the closures add, flush,
// delivered and lost that share its batch, timer and quarantine state;
// splitting them further would spread that state over several types.
func (c *Consumer) session(ctx context.Context, quarantine *bool) (err error) {
	// Last, once the writers and the acker are done: what is still unacked
	// is redelivered (publishIDs).
	defer func() { c.ids.sessionEnded(time.Now()) }()
	conn, err := c.dial()
	if err != nil {
		return fmt.Errorf("audit: connecting: %w", err)
	}
	defer conn.Close()
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	defer func() {
		// A delivery the client cannot decode may close the connection
		// while the session is still being set up: any error then.
		var u errUndecodable
		if err != nil && !errors.As(err, &u) {
			select {
			case e := <-closed:
				if cerr := c.connClosed(e); errors.As(cerr, &u) {
					err = cerr
				}
			default:
			}
		}
	}()
	token, err := c.setUp(conn)
	if err != nil {
		return err
	}
	arrCh, arrD, err := c.consume(conn, c.cfg.Naming.ArrivalsQueue, *quarantine)
	if err != nil {
		return err
	}
	attCh, attD, err := c.consume(conn, c.cfg.Naming.AttemptsQueue, *quarantine)
	if err != nil {
		return err
	}
	c.cfg.Logger.Info("Audit consumer connected", watermill.LogFields{
		"arrivals_queue": c.cfg.Naming.ArrivalsQueue, "attempts_queue": c.cfg.Naming.AttemptsQueue, "one_at_a_time": *quarantine,
	})
	batchSize, quarantined := c.cfg.BatchSize, 0
	if *quarantine {
		batchSize = 1
	}
	// delivered counts a delivery; in quarantine, the last one ends it.
	delivered := func() error {
		if !*quarantine {
			return nil
		}
		if quarantined++; quarantined < (c.cfg.Writers+1)*c.cfg.BatchSize {
			return nil
		}
		for _, ch := range []*amqp.Channel{arrCh, attCh} {
			if err := ch.Qos((c.cfg.Writers+1)*c.cfg.BatchSize, 0, false); err != nil {
				return err
			}
		}
		*quarantine, batchSize = false, c.cfg.BatchSize
		c.cfg.Logger.Info("Audit consumer back to full prefetch after an undecodable delivery", nil)
		return nil
	}
	// lost is the session's error when a consumer's delivery channel
	// closed: the connection's close reason if it has one (amqp091-go
	// sends it before closing the channels).
	lost := func(what string) error {
		select {
		case e := <-closed:
			return c.connClosed(e)
		default:
			return errors.New("audit: " + what + " consumer cancelled or channel closed")
		}
	}

	// Writers goroutines write batches concurrently while the next one
	// fills (the prefetch of (Writers+1)×BatchSize per channel allows
	// it). Each batch goes to the acker too, in the order it was filled;
	// the acker waits for each one's commit in that order before acking
	// it, so a multiple ack never covers a delivery of an unwritten batch.
	batches := make(chan batch)
	toAck := make(chan batch, c.cfg.Writers+1)
	werr := make(chan error, 1)
	fail := func(err error) {
		select {
		case werr <- err:
		default: // the session is ending already
		}
	}
	wctx, wcancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range c.cfg.Writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.writeBatches(wctx, conn, token, batches, fail)
		}()
	}
	// With a delivery log, the acker marks a batch's rows Acking right
	// before its ack (deleting the rows it marked before: their acks were
	// sent); marked says the last marked rows' ack was sent, so a session
	// that ends with its connection open deletes them too.
	marked := false
	wg.Add(1)
	go func() {
		defer wg.Done()
		c.ackBatches(wctx, conn, token, arrCh, attCh, toAck, fail, &marked)
	}()
	defer func() {
		wcancel()
		close(batches)
		close(toAck)
		wg.Wait()
		if marked && !conn.IsClosed() { // the acks were sent on an open connection
			c.storeCall("Deleting the unacked-delivery rows of acked arrivals", 0, func(ctx context.Context) error {
				return c.log.DeliveriesAcking(ctx, token, nil)
			})
		}
	}()

	var b batch
	var timer *time.Timer
	var timerC <-chan time.Time
	flush := func() error {
		if timer != nil {
			timer.Stop()
			timer, timerC = nil, nil
		}
		if b.pending == 0 {
			return nil
		}
		b.committed = make(chan struct{})
		for _, q := range []chan batch{toAck, batches} { // toAck first: the acker sees batches in fill order
			select {
			case q <- b:
			case err := <-werr:
				return err
			case err := <-closed:
				return c.connClosed(err)
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		b = batch{} // fresh slices: the writer and the Store own the old ones
		return nil
	}
	add := func() error {
		if b.pending == 1 && timer == nil {
			timer = time.NewTimer(c.cfg.BatchWait)
			timerC = timer.C
		}
		if err := delivered(); err != nil {
			return err
		}
		if b.records >= batchSize {
			return flush()
		}
		return nil
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-closed:
			return c.connClosed(err)
		case err := <-werr:
			return err
		case <-timerC:
			timer, timerC = nil, nil
			if err := flush(); err != nil {
				return err
			}
		case d, ok := <-arrD:
			if !ok {
				return lost("arrivals")
			}
			c.takeArrival(d, &b)
			if err := add(); err != nil {
				return err
			}
		case d, ok := <-attD:
			if !ok {
				return lost("attempts")
			}
			c.takeAttempt(d, &b)
			if err := add(); err != nil {
				return err
			}
		}
	}
}

// setUp declares the topology and, with a delivery log, the session queue
// holding this session's token; errors that another try cannot fix are
// errFatal.
func (c *Consumer) setUp(conn *amqp.Connection) (token string, err error) {
	if err := c.declare(conn); err != nil {
		var ae *amqp.Error
		if errors.Is(err, ErrExchangeNotFound) || (errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed) {
			return "", errFatal{err}
		}
		return "", err
	}
	token = randomToken()
	if c.log != nil {
		if err := c.holdSession(conn, token); err != nil {
			var ae *amqp.Error
			if errors.As(err, &ae) && ae.Code == amqp.AccessRefused {
				return "", errFatal{fmt.Errorf("audit: declaring the session queue %q (the user needs configure permission on it): %w", c.sessionQueue(token), err)}
			}
			return "", fmt.Errorf("audit: declaring the session queue: %w", err)
		}
	}
	return token, nil
}

// consume opens a channel consuming queue with the session's prefetch:
// (Writers+1)×BatchSize, or 1 in quarantine.
func (c *Consumer) consume(conn *amqp.Connection, queue string, quarantine bool) (*amqp.Channel, <-chan amqp.Delivery, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, nil, err
	}
	prefetch := (c.cfg.Writers + 1) * c.cfg.BatchSize
	if quarantine {
		prefetch = 1
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return nil, nil, err
	}
	d, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("audit: consuming %q: %w", queue, err)
	}
	return ch, d, nil
}

// writeBatches is one writer: it stores each batch with records and closes
// its committed channel; on an error it reports it with fail and stops.
func (c *Consumer) writeBatches(ctx context.Context, conn *amqp.Connection, token string, batches <-chan batch, fail func(error)) {
	for b := range batches {
		if b.records > 0 {
			if err := c.store(ctx, conn, token, &b); err != nil {
				fail(err)
				return
			}
		}
		close(b.committed)
	}
}

// ackBatches is the acker: it waits for each batch's commit in fill order,
// marks its delivery log rows Acking (marked says the last marked rows' ack
// was sent), then acks it; on an error it reports it with fail and stops.
func (c *Consumer) ackBatches(ctx context.Context, conn *amqp.Connection, token string, arrCh, attCh *amqp.Channel, toAck <-chan batch, fail func(error), marked *bool) {
	for b := range toAck {
		select {
		case <-b.committed:
		case <-ctx.Done():
			return
		}
		ids := c.ackingIDs(b)
		if ids != nil {
			*marked = false
			if err := c.markAcking(ctx, conn, token, ids); err != nil {
				fail(err)
				return
			}
		}
		if arrAcked, err := c.ack(arrCh, attCh, b); err != nil {
			if ids != nil && !arrAcked { // not sent: its redeliveries may claim the rows
				c.storeCall("Clearing the acking mark of unacked-delivery rows", len(ids), func(ctx context.Context) error {
					return c.log.DeliveriesNotAcked(ctx, token, ids)
				})
			}
			fail(err)
			return
		}
		*marked = *marked || ids != nil
	}
}

// takeArrival adds an arrivals-queue delivery to b.
func (c *Consumer) takeArrival(d amqp.Delivery, b *batch) {
	a := c.arrival(d)
	b.arrivals = append(b.arrivals, a)
	if c.log != nil {
		b.fps = append(b.fps, fingerprint(c.cfg.Naming.ArrivalsQueue, a.contentID))
		b.redelivered = append(b.redelivered, d.Redelivered)
		b.resolved = append(b.resolved, !d.Redelivered)
		b.claimed = append(b.claimed, false)
	}
	b.arrTag, b.records, b.pending = d.DeliveryTag, b.records+1, b.pending+1
}

// takeAttempt adds an attempts-queue delivery to b: as a record if it
// decodes and comes from a trusted user, else only to be acked (counted
// and logged as untrusted or malformed).
func (c *Consumer) takeAttempt(d amqp.Delivery, b *batch) {
	a, err := unmarshalAttempt(d.Body)
	if err == nil && (a.ID == "" || a.MessageID == "") {
		err = errors.New("record without id or message_id")
	}
	a.RecordedBy = d.UserId // broker-validated, never the body's
	b.attTag, b.pending = d.DeliveryTag, b.pending+1
	if err == nil && !c.trusted(d.UserId) {
		c.untrusted.Add(1)
		c.cfg.Logger.Error("Attempt record from an untrusted user; acking it, not stored", errUntrusted, watermill.LogFields{
			"message_id": d.MessageId, "user_id": d.UserId, "record_message_id": a.MessageID,
		})
	} else if err != nil {
		c.malformed.Add(1)
		c.cfg.Logger.Error("Malformed attempt record; acking it", err, watermill.LogFields{
			"message_id": d.MessageId, "body": truncate(string(d.Body), 200),
		})
	} else {
		b.attempts = append(b.attempts, a)
		b.records++
	}
}

// ack acks b's deliveries (one multiple ack per channel); called only
// once b and every batch filled before it committed and were acked.
// arrAcked: the arrivals' ack was sent (or b has none).
func (c *Consumer) ack(arrCh, attCh *amqp.Channel, b batch) (arrAcked bool, err error) {
	if b.arrTag > 0 {
		if err := arrCh.Ack(b.arrTag, true); err != nil {
			return false, fmt.Errorf("audit: acking arrivals: %w", err)
		}
		if c.log == nil {
			c.ids.acked(b.arrivals)
		}
	}
	if b.attTag > 0 {
		if err := attCh.Ack(b.attTag, true); err != nil {
			return true, fmt.Errorf("audit: acking attempt records: %w", err)
		}
	}
	return true, nil
}

// store writes the records, splitting a batch the Store rejects for good
// (ErrRecordRejected) in halves until the rejected records are alone, and
// setting those aside. It returns an error only if ctx ends or the
// connection is lost meanwhile (then the batch is dropped from memory and
// the broker redelivers it; writes are idempotent).
func (c *Consumer) store(ctx context.Context, conn *amqp.Connection, token string, b *batch) error {
	err := c.write(ctx, conn, token, b)
	if err == nil || !errors.Is(err, ErrRecordRejected) {
		return err
	}
	if len(b.arrivals)+len(b.attempts) == 1 {
		return c.setAsideRecord(ctx, conn, b.arrivals, b.attempts, err)
	}
	for _, part := range b.halves() {
		if err := c.store(ctx, conn, token, part); err != nil {
			return err
		}
	}
	return nil
}

// halves splits b's records in two parts (arrivals apart from attempts
// first) for store. The parts share b's slices, so what write and
// claimRedelivered record on a part (final arrival IDs, claims) is b's.
func (b *batch) halves() []*batch {
	part := func(from, to int, arrivals bool) *batch {
		p := &batch{}
		if arrivals {
			p.arrivals = b.arrivals[from:to]
			if b.fps != nil {
				p.fps, p.redelivered = b.fps[from:to], b.redelivered[from:to]
				p.resolved, p.claimed = b.resolved[from:to], b.claimed[from:to]
			}
		} else {
			p.attempts = b.attempts[from:to]
		}
		return p
	}
	na, nt := len(b.arrivals), len(b.attempts)
	switch {
	case na > 0 && nt > 0:
		return []*batch{part(0, na, true), part(0, nt, false)}
	case na > 1:
		return []*batch{part(0, na/2, true), part(na/2, na, true)}
	default:
		return []*batch{part(0, nt/2, false), part(nt/2, nt, false)}
	}
}

// setAsideRecord keeps the one record of arr or att, rejected with
// reason, in the Store's SetAside. Without a SetAsider it retries the
// write forever (the old behaviour: the queue stalls, loudly).
func (c *Consumer) setAsideRecord(ctx context.Context, conn *amqp.Connection, arr []Arrival, att []Attempt, reason error) error {
	sa, ok := c.cfg.Store.(SetAsider)
	var rec SetAside
	if len(arr) == 1 {
		rec = SetAside{Kind: auditconst.KindArrival, RecordID: arr[0].ID, MessageID: arr[0].MessageID, Reason: reason.Error()}
		rec.Record, _ = json.Marshal(arr[0])
	} else {
		rec = SetAside{Kind: auditconst.KindAttempt, RecordID: att[0].ID, MessageID: att[0].MessageID, Reason: reason.Error()}
		rec.Record, _ = json.Marshal(att[0])
	}
	if !ok {
		c.cfg.Logger.Error("Audit store rejected a record for good and cannot set it aside (no SetAsider); retrying it", reason,
			watermill.LogFields{"kind": rec.Kind, "record_id": truncate(rec.RecordID, 100)})
		return c.retry(ctx, conn, "write", func(ctx context.Context) error {
			err := c.cfg.Store.Write(ctx, arr, att)
			if errors.Is(err, ErrRecordRejected) {
				return fmt.Errorf("%v (rejected)", err) // retried, not split again
			}
			return err
		})
	}
	err := c.retry(ctx, conn, "set-aside", func(ctx context.Context) error { return sa.SetAside(ctx, []SetAside{rec}) })
	if err != nil {
		return err
	}
	c.setAside.Add(1)
	c.cfg.Logger.Error("Audit record set aside: the store rejects it for good", reason, watermill.LogFields{
		"kind": rec.Kind, "record_id": truncate(rec.RecordID, 100), "message_id": truncate(rec.MessageID, 100),
	})
	return nil
}

// write calls Store.Write until it returns nil or an ErrRecordRejected
// (returned at once); another error only if ctx ends or the connection is
// lost meanwhile.
//
// With a delivery log, redelivered arrivals that a row of an ended session
// holds are claimed first (stored already: only their rows are written
// again), and every arrival's row is written in the same transaction.
func (c *Consumer) write(ctx context.Context, conn *amqp.Connection, token string, b *batch) error {
	start := time.Now()
	arr, att := b.arrivals, b.attempts
	err := c.retry(ctx, conn, "write", func(ctx context.Context) error {
		start = time.Now()
		arr = b.arrivals
		if c.log == nil {
			return c.cfg.Store.Write(ctx, arr, att)
		}
		if err := c.claimRedelivered(ctx, conn, token, b); err != nil {
			return err
		}
		arr = make([]Arrival, 0, len(b.arrivals))
		dels := make([]unackedDelivery, len(b.arrivals))
		for i := range b.arrivals {
			if !b.claimed[i] {
				arr = append(arr, b.arrivals[i])
			}
			dels[i] = unackedDelivery{ArrivalID: b.arrivals[i].ID, Fingerprint: b.fps[i], Session: token}
		}
		return c.log.WriteDeliveries(ctx, arr, att, dels)
	})
	if err != nil {
		return err
	}
	c.lastLatency.Store(int64(time.Since(start)))
	c.batches.Add(1)
	c.arrivals.Add(uint64(len(arr)))
	c.attempts.Add(uint64(len(att)))
	if len(att) > 0 {
		var newest time.Time
		for _, a := range att {
			if end := a.StartedAt.Add(a.Duration); end.After(newest) {
				newest = end
			}
		}
		c.lag.Store(int64(max(time.Since(newest), 0)))
	}
	return nil
}

// retry calls fn until it returns nil or an ErrRecordRejected, pacing
// other errors with WriteBackoff; it gives up if ctx ends or the
// connection is lost meanwhile.
func (c *Consumer) retry(ctx context.Context, conn *amqp.Connection, op string, fn func(context.Context) error) error {
	var bo backoff.BackOff
	var since time.Time
	for {
		start := time.Now()
		err := fn(ctx)
		if err == nil {
			if bo != nil {
				c.cfg.Logger.Info("Audit store writable again", watermill.LogFields{"outage": time.Since(since).String()})
			}
			return nil
		}
		c.failures.Add(1)
		if errors.Is(err, ErrRecordRejected) {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if bo == nil {
			bo, since = c.cfg.WriteBackoff(), start
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			wait = 30 * time.Second
		}
		c.cfg.Logger.Error("Audit store "+op+" failed; records stay unacked in RabbitMQ, retrying", err, watermill.LogFields{
			"retry_in": wait.String(), "outage": time.Since(since).String(),
		})
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		if conn.IsClosed() {
			return errors.New("audit: connection lost while the store was down; the broker redelivers the batch")
		}
	}
}
