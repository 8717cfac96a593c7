package cascadecore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"sort"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"
)

type levelQueue struct {
	level int
	queue string
}

type censusRun struct {
	c    *core
	opts CensusOptions
	id   string
	size int // batch size: prefetch and messages per transaction

	rep     *CensusReport
	entries map[levelQueue]*CensusEntry
}

func newRunID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// censusGrace is how long Census lets a broker operation in progress
// (a commit, a cancel) finish after ctx ended before it abandons the
// connection.
const censusGrace = 2 * time.Second

// errAbandoned: the census stopped waiting for the broker (ctx ended and
// the operation did not finish within censusGrace).
var errAbandoned = errors.New("cascade: census abandoned: the broker did not answer within 2 s of the deadline (blocked by a resource alarm?); every message is either put back (its transaction committed) or still in its level queue")

// level takes out and puts back the messages of level n in transactions
// (see Census): it stops once it has taken the level's count at start, met
// a message of its own, found the queue empty, or ctx ended.
func (r *censusRun) level(ctx context.Context, n int) error {
	ch, err := r.c.pub.Channel()
	if err != nil {
		return err
	}
	w := &watched{ctx: ctx}
	defer r.closeLevel(ch, w)
	lc, err := r.startLevel(ch, w.call, n)
	if err != nil || lc.q.Messages == 0 {
		return err
	}
	taken := 0
	stop := false
	var stopErr error
	for !stop {
		var batch []amqp.Delivery
		batch, stop, stopErr = r.collect(ctx, ch, w.call, n, lc, taken)
		if ctx.Err() != nil {
			// Interrupted: the batch is not put back; the cancel or the
			// channel's close returns it, untouched.
			r.rep.Returned += len(batch)
			break
		}
		if len(batch) == 0 {
			break
		}
		taken += len(batch)
		if err := r.commit(ch, w.call, n, batch, lc.returns); err != nil {
			return err
		}
		if taken >= lc.q.Messages {
			stop = true
		}
	}
	if stopErr != nil {
		return stopErr
	}
	if err := w.call(func() error { return ch.Cancel(lc.tag, false) }); err != nil {
		return fmt.Errorf("cascade: cancelling the census consumer on %q: %w", lc.q.Name, err)
	}
	extra := 0
	for range lc.ds { // sent before the cancel: returned by the broker, not put back
		extra++
	}
	r.rep.Returned += extra
	return ctx.Err()
}

// watched runs broker round trips under a census's ctx (see call).
type watched struct {
	ctx       context.Context
	abandoned atomic.Bool
}

// call runs a broker round trip f; once ctx has ended it waits censusGrace
// more, then marks the channel abandoned (see censusRun.abandon) and
// returns errAbandoned.
func (w *watched) call(f func() error) error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-w.ctx.Done():
	}
	select {
	case err := <-done:
		return err
	case <-time.After(censusGrace):
		w.abandoned.Store(true)
		return errAbandoned
	}
}

// closeLevel closes a level's census channel, or abandons it when a call
// was abandoned or the close takes longer than censusGrace.
func (r *censusRun) closeLevel(ch *amqp.Channel, w *watched) {
	if w.abandoned.Load() {
		r.abandon(ch)
		return
	}
	done := make(chan struct{})
	go func() { _ = ch.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(censusGrace):
		r.abandon(ch)
	}
}

// levelConsumer is a level's census consumer: the level queue's state at
// start (q.Messages is the count to take), its deliveries, the returns of
// its put-back copies and its consumer tag.
type levelConsumer struct {
	q       amqp.Queue
	ds      <-chan amqp.Delivery
	returns <-chan amqp.Return
	tag     string
}

// startLevel reads level n's count and, unless it is empty, starts
// consuming it in transaction mode with prefetch r.size.
func (r *censusRun) startLevel(ch *amqp.Channel, call func(func() error) error, n int) (levelConsumer, error) {
	cfg := &r.c.cfg
	var lc levelConsumer
	if err := call(func() (err error) {
		lc.q, err = ch.QueueDeclarePassive(cfg.LevelName(n), true, false, false, false, cfg.levelArgs(n))
		return err
	}); err != nil {
		return lc, fmt.Errorf("cascade: inspecting level queue %q: %w", cfg.LevelName(n), err)
	}
	if lc.q.Messages == 0 {
		return lc, nil
	}
	q := lc.q
	if err := call(func() error { return ch.Qos(r.size, 0, false) }); err != nil {
		return lc, fmt.Errorf("cascade: setting the prefetch on %q: %w", q.Name, err)
	}
	if err := call(ch.Tx); err != nil {
		return lc, fmt.Errorf("cascade: selecting transactions on %q: %w", q.Name, err)
	}
	lc.returns = ch.NotifyReturn(make(chan amqp.Return, r.size+1))
	lc.tag = "rabbitretry-census-" + r.id
	if err := call(func() (err error) {
		lc.ds, err = ch.Consume(q.Name, lc.tag, false, false, false, false, nil)
		return err
	}); err != nil {
		return lc, fmt.Errorf("cascade: consuming %q: %w", q.Name, err)
	}
	return lc, nil
}

// collect gathers the next batch of level n's deliveries (taken already
// taken): up to r.size, or the level's count at start, or what came before
// a pause. stop: the level is done after this batch (its consumer ended,
// a message of this census came round, the queue is empty, or ctx ended),
// with stopErr when that is an error.
func (r *censusRun) collect(ctx context.Context, ch *amqp.Channel, call func(func() error) error, n int, lc levelConsumer, taken int) (batch []amqp.Delivery, stop bool, stopErr error) {
	cfg := &r.c.cfg
	q := lc.q
	idle := time.NewTimer(200 * time.Millisecond)
	defer idle.Stop()
	for len(batch) < r.size && taken+len(batch) < q.Messages {
		select {
		case d, open := <-lc.ds:
			if !open {
				return batch, true, fmt.Errorf("cascade: the census consumer on %q ended (channel closed): the messages it held go back to the level queue", q.Name)
			}
			if d.Headers[censusHeader] == r.id {
				r.rep.Returned++ // gone round: left to the cancel, which returns it
				return batch, true, nil
			}
			batch = append(batch, d)
			idle.Reset(50 * time.Millisecond) // Go 1.23+: no stale tick survives a Reset
		case <-idle.C:
			if len(batch) > 0 {
				return batch, false, nil // commit what came; more may follow
			}
			var st amqp.Queue
			if err := call(func() (err error) {
				st, err = ch.QueueDeclarePassive(q.Name, true, false, false, false, cfg.levelArgs(n))
				return err
			}); err != nil || st.Messages == 0 {
				return batch, true, err // empty: the rest moved to a lower level meanwhile
			}
			idle.Reset(200 * time.Millisecond)
		case <-ctx.Done():
			return batch, true, nil
		}
	}
	return batch, false, nil
}

// abandon gives up on ch without waiting for the broker: the census's own
// connection (Config.URI) is closed at once, its socket first (whatever
// the broker has not read yet is then read, in order, or not at all: a
// transaction is applied whole or not); on a Config.Publisher's
// connection, only ch is closed, in the background.
func (r *censusRun) abandon(ch *amqp.Channel) {
	if r.c.ownPub {
		_ = r.c.pub.Close()
		return
	}
	go func() { _ = ch.Close() }()
}

// putBackCopy is one message of a batch, ready to publish back.
type putBackCopy struct {
	d                  amqp.Delivery
	p                  amqp.Publishing
	exchange, key      string
	dest, movedTo      string
	due                time.Time
	noDue, clamped, ok bool // ok: a cascade key (else foreign)
}

// commit publishes the batch's copies and acknowledges their originals in
// one transaction (tx.select, RabbitMQ "AMQP 0-9-1 Reference", tx class):
// the broker applies both on tx.commit, or neither if the channel or
// connection closes before the commit arrives, so an interruption at any
// point leaves each message either put back or where it was, never both.
// Publishes are mandatory: a copy returned as unroutable (a level queue or
// binding deleted meanwhile) is republished, confirmed, after redeclaring
// the cascade.
func (r *censusRun) commit(ch *amqp.Channel, call func(func() error) error, n int, batch []amqp.Delivery, returns <-chan amqp.Return) error {
	cfg := &r.c.cfg
	now := time.Now()
	copies := make([]putBackCopy, len(batch))
	for i, d := range batch {
		copies[i] = r.prepare(n, d, now)
	}
	r.rep.Taken += len(batch)
	if err := call(func() error {
		for _, c := range copies {
			if err := ch.Publish(c.exchange, c.key, true, false, c.p); err != nil {
				return err
			}
		}
		for _, c := range copies {
			if err := c.d.Ack(false); err != nil {
				return err
			}
		}
		return ch.TxCommit()
	}); err != nil {
		return fmt.Errorf("cascade: putting back %d message(s) from %q (transaction not confirmed: they are either put back or still there): %w", len(batch), cfg.LevelName(n), err)
	}
	// basic.return precedes tx.commit-ok: every return of this batch is in.
	for done := false; !done; {
		select {
		case ret := <-returns:
			if err := r.reroute(ret); err != nil {
				return err
			}
		default:
			done = true
		}
	}
	for _, c := range copies {
		r.count(n, c)
	}
	return nil
}

// reroute republishes a put-back copy the broker returned (unroutable: its
// level queue or binding was deleted), after redeclaring the cascade, with
// publisher confirms.
func (r *censusRun) reroute(ret amqp.Return) error {
	p := amqp.Publishing{
		Headers: ret.Headers, ContentType: ret.ContentType, ContentEncoding: ret.ContentEncoding,
		DeliveryMode: ret.DeliveryMode, Priority: ret.Priority, CorrelationId: ret.CorrelationId, ReplyTo: ret.ReplyTo,
		MessageId: ret.MessageId, Timestamp: ret.Timestamp, Type: ret.Type, UserId: ret.UserId, AppId: ret.AppId, Body: ret.Body,
	}
	ch, err := r.c.pub.Channel()
	if err == nil {
		err = r.c.declare(ch)
		_ = ch.Close()
	}
	if err == nil {
		err = r.c.pub.PublishRaw(context.Background(), ret.Exchange, ret.RoutingKey, p)
	}
	if err != nil {
		return fmt.Errorf("cascade: a put-back copy was unroutable (%s %q) and republishing it failed; its body is %d bytes, message id %q: %w",
			ret.Exchange, ret.RoutingKey, len(ret.Body), ret.MessageId, err)
	}
	r.c.cfg.Logger.Error("Census: a put-back copy was unroutable; redeclared the cascade and republished it", nil,
		watermill.LogFields{"exchange": ret.Exchange, "routing_key": ret.RoutingKey})
	return nil
}

// prepare builds d's put-back copy (found in level n, at now): its
// remaining delay is dueHeader − now, clamped to what level n and the key's
// lower bits allow: at least the lower bits (still to wait after level n),
// at most those plus level n's whole TTL. A copy due now goes to level 0
// with one grain (never straight to the destination: an unbound
// destination would make it unroutable, and the original is acked in the
// same transaction).
func (r *censusRun) prepare(n int, d amqp.Delivery, now time.Time) putBackCopy {
	cfg := &r.c.cfg
	c := putBackCopy{d: d, p: amqp.Publishing{
		Headers: maps.Clone(d.Headers), ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: d.DeliveryMode, Priority: d.Priority, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo,
		MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type, UserId: d.UserId, AppId: d.AppId, Body: d.Body,
	}}
	if c.p.Headers == nil {
		c.p.Headers = amqp.Table{}
	}
	c.p.Headers[censusHeader] = r.id
	bits, queue, perr := cfg.parseKey(d.RoutingKey)
	if perr != nil {
		// Not a cascade key: back into the same level queue, unchanged.
		c.exchange, c.key = "", cfg.LevelName(n)
		return c
	}
	c.ok, c.dest = true, queue
	low := time.Duration(bits&(uint64(1)<<uint(n)-1)) * cfg.Grain
	earliest, latest := now.Add(low), now.Add(low+levelTTL(cfg.Grain, n))
	due, ok := parseDue(c.p.Headers[dueHeader])
	switch {
	case !ok:
		c.noDue, due = true, latest
	case due.After(latest):
		c.clamped, due = true, latest
	case due.Before(earliest):
		c.clamped, due = true, earliest
	}
	c.due = due
	c.p.Headers[dueHeader] = formatDue(due)
	target := queue
	if to, ok := r.opts.Move[queue]; ok {
		c.movedTo = to
		if !r.opts.DryRun {
			target = to
		}
	}
	grains, _ := cfg.grains(due.Sub(now))
	if maxN := uint64(1)<<uint(cfg.Levels) - 1; grains > maxN {
		grains = maxN
	}
	grains = max(grains, 1)
	c.key, _ = cfg.routingKey(grains, target) // target was checked
	c.exchange = cfg.EntryExchange(grains)
	return c
}

// count adds a committed copy to the report.
func (r *censusRun) count(n int, c putBackCopy) {
	r.rep.PutBack++
	if !c.ok {
		r.rep.Foreign++
		return
	}
	r.rep.Counted++
	if c.movedTo != "" {
		r.rep.Moved++
	}
	if c.clamped {
		r.rep.Clamped++
	}
	e := r.entries[levelQueue{n, c.dest}]
	if e == nil {
		e = &CensusEntry{Level: n, Queue: c.dest, EarliestDue: c.due, LatestDue: c.due, MovedTo: c.movedTo}
		r.entries[levelQueue{n, c.dest}] = e
	}
	e.add(c.due, c.noDue)
}

func (e *CensusEntry) add(due time.Time, noDue bool) {
	e.Messages++
	if due.Before(e.EarliestDue) {
		e.EarliestDue = due
	}
	if due.After(e.LatestDue) {
		e.LatestDue = due
	}
	if noDue {
		e.NoDueHeader++
	}
}

// finish fills Entries and Destinations; the put-backs have all returned.
func (r *censusRun) finish() {
	totals := map[string]*CensusEntry{}
	for _, e := range r.entries {
		r.rep.Entries = append(r.rep.Entries, *e)
		t := totals[e.Queue]
		if t == nil {
			t = &CensusEntry{Level: -1, Queue: e.Queue, EarliestDue: e.EarliestDue, LatestDue: e.LatestDue, MovedTo: e.MovedTo}
			totals[e.Queue] = t
		}
		t.Messages += e.Messages
		t.NoDueHeader += e.NoDueHeader
		if e.EarliestDue.Before(t.EarliestDue) {
			t.EarliestDue = e.EarliestDue
		}
		if e.LatestDue.After(t.LatestDue) {
			t.LatestDue = e.LatestDue
		}
	}
	for _, t := range totals {
		r.rep.Destinations = append(r.rep.Destinations, *t)
	}
	sort.Slice(r.rep.Entries, func(i, j int) bool {
		a, b := r.rep.Entries[i], r.rep.Entries[j]
		if a.Level != b.Level {
			return a.Level < b.Level
		}
		return a.Queue < b.Queue
	})
	sort.Slice(r.rep.Destinations, func(i, j int) bool { return r.rep.Destinations[i].Queue < r.rep.Destinations[j].Queue })
}

// formatDue writes a dueHeader value: Unix milliseconds, decimal.
func formatDue(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// parseDue reads a dueHeader value (a decimal string, or an integer if a
// client wrote one).
func parseDue(v any) (time.Time, bool) {
	var ms int64
	switch v := v.(type) {
	case string:
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return time.Time{}, false
		}
		ms = n
	case int64:
		ms = v
	case int32:
		ms = int64(v)
	case int:
		ms = int64(v)
	default:
		return time.Time{}, false
	}
	return time.UnixMilli(ms), true
}
