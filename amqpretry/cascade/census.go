package cascade

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

// CensusOptions tunes Census. The zero value counts every level and moves
// nothing.
type CensusOptions struct {
	// Move maps a destination queue to a new one: every message Census
	// finds addressed to a key of Move is put back addressed to its value
	// instead, keeping its remaining delay. The new destinations must
	// exist; Census binds them (BindDestination) before taking anything
	// out. A destination may not be moved to itself, and the new name must
	// be routable (ErrBadQueueName).
	Move map[string]string
	// Levels restricts the census to these levels (0 .. Levels-1); nil or
	// empty means all of them.
	Levels []int
	// DryRun counts what Move would move (CensusReport.Moved) but puts
	// every message back to its own destination. Reading a level queue
	// still takes each message out and puts it back: a dry run is as
	// disturbing as a census.
	DryRun bool
	// Concurrency is the number of messages taken out and not yet put
	// back at once: the census consumer's prefetch and the largest batch
	// put back in one transaction (see Census). Default 128. Measured on a
	// 2-core machine with RabbitMQ 4.3.6: 3,000 messages in 12 quorum
	// levels in about 1 s.
	Concurrency int
}

// CensusEntry counts the messages of one destination in one level (or, in
// CensusReport.Destinations, in all levels: Level is -1).
type CensusEntry struct {
	// Level is the level queue the messages were in; -1 for a total.
	Level int `json:"level"`
	// Queue is the destination the messages were addressed to when found.
	Queue string `json:"queue"`
	// Messages is how many there were.
	Messages int `json:"messages"`
	// EarliestDue and LatestDue bound their due times (DueHeader, or the
	// estimate Census used for messages without one).
	EarliestDue time.Time `json:"earliest_due"`
	LatestDue   time.Time `json:"latest_due"`
	// NoDueHeader counts those without DueHeader (published by an older
	// version): their due time is an upper bound, see Census.
	NoDueHeader int `json:"no_due_header,omitempty"`
	// MovedTo is Move[Queue] when Queue was in CensusOptions.Move.
	MovedTo string `json:"moved_to,omitempty"`
}

// CensusReport is what Census found and did.
type CensusReport struct {
	// Entries has one entry per level and destination, by level then
	// queue name.
	Entries []CensusEntry `json:"entries"`
	// Destinations totals Entries per destination, by queue name.
	Destinations []CensusEntry `json:"destinations"`
	// Taken is the number of messages taken out of the level queues and
	// put back or tried to, Counted those counted in Entries (Taken less
	// Foreign), PutBack those put back and acknowledged (transaction
	// committed): after a successful census PutBack == Taken; after an
	// abandoned one, the last batch is either put back or untouched.
	Taken, Counted, PutBack int
	// Moved is the number of counted messages addressed to a destination of
	// CensusOptions.Move (put back to the new destination, unless DryRun).
	Moved int
	// Clamped is the number of counted messages whose DueHeader lay outside
	// what their level and routing key allow (a sender's clock off, or a
	// header set by hand): put back with the nearest delay they can have
	// left (see Census), not the header's.
	Clamped int
	// Returned is the number of deliveries the census consumer got and did
	// not put back (after deciding to stop: its own put-back copies,
	// mostly; or held when ctx ended), left to the broker to return to the
	// level queue, untouched (at most Concurrency per level).
	Returned int
	// Foreign is the number of messages in a level queue whose routing key
	// is not a cascade key of this Config (a cascade declared with other
	// Levels, or a message published there by hand): put back into the
	// same level queue unchanged, through the default exchange.
	Foreign int
	// Started and Finished bound the census.
	Started, Finished time.Time
}

// Census takes every message out of the cascade's level queues, one level
// at a time from the top, counts them per level and destination (with
// their earliest and latest due time), and puts each back into the cascade
// with its remaining delay, to the same destination or to the one
// opts.Move names. It is the only way to see destinations and due times:
// both are in each message's routing key and DueHeader, readable only by
// taking the message. Use Waiting for per-level counts without
// disturbing anything.
//
// How a message is put back: its remaining delay is due − now (DueHeader),
// clamped to what its level and routing key allow: at least the key's
// lower bits (what it must still wait after this level), at most those
// plus this level's whole TTL (2^n grains); a header outside that range (a
// sender's clock off, a header set by hand) is not trusted
// (CensusReport.Clamped). Rounded up to the grain, at least one grain (a
// copy due now goes through level 0, never straight to its destination:
// if the destination is unbound then, level 0's at-least-once
// dead-lettering keeps it). The copy is published (mandatory) to the
// entry exchange for that many grains.
//
// Transactions: Census consumes a level queue on a channel in transaction
// mode (tx.select; RabbitMQ "AMQP 0-9-1 Reference", tx class) with prefetch
// Concurrency, and puts messages back in batches: the copies' publishes and
// the originals' acks, then tx.commit. The broker applies a batch whole on
// commit, or not at all if the channel or connection ends before the
// commit reached it; so an interruption at any point (Ctrl-C, a deadline,
// a dropped connection, a resource alarm blocking the connection) leaves
// each message either put back or where it was, never both (no
// duplicate) and never neither (no loss). A copy the broker returns as
// unroutable (a level queue or binding deleted meanwhile) has been acked
// with its batch: Census redeclares the cascade and republishes it with
// publisher confirms (logged), and returns an error if that fails. The
// limit: RabbitMQ applies a transaction's publishes and acks to each queue
// separately, so a broker node failing in the middle of a commit
// (milliseconds per batch) can apply some and not others ("Reliability
// Guide" and "AMQP 0-9-1 semantics", transactions across queues).
//
// Bounded: every broker round trip is watched; once ctx has ended, Census
// waits at most 2 s more for the one in progress, then abandons the
// connection (with Config.URI, its own connection, closed at once; with a
// Config.Publisher, the census channel is closed in the background) and
// returns: within ctx's deadline + about 2 s even while a disk or memory
// alarm blocks the connection (RabbitMQ "Blocked Connection
// Notifications"). Whatever the broker had not read of an abandoned batch
// is read later in order, or not at all: still all or nothing. Measured on
// RabbitMQ 4.3.6 during a disk alarm with a 3 s deadline: returned after
// 5.0 s, 0 of 100 messages duplicated, lost or early
// (faults.TestCascadeCensusDiskAlarm).
//
// Deliveries Census does not put back (those after it decided to stop,
// mostly its own copies: CensusReport.Returned) go back to the queue
// untouched when it cancels its consumer or its channel ends. On RabbitMQ
// 4.x that counts a delivery attempt each; the level queues' delivery limit
// (LevelDeliveryLimit, 2^31-1) is never reached, so no number of
// interrupted censuses moves a message on early. (Level queues declared by
// an earlier version without x-delivery-limit have the broker's default,
// 20 on 4.x: recreate them, see the README.) While a message is held it
// does not expire; its copy has its remaining delay, so the hold costs no
// lateness, except when an alarm delays a commit: the copies then enter
// the cascade when the alarm clears, with the delay computed before it.
//
// Timing: a message is exact to the grain plus the time it was held
// (milliseconds) when it carries DueHeader (the Delayer and Publisher stamp
// it). One without it (published by a version before DueHeader) is put
// back with the largest delay it can have left: the lower levels' bits of
// its key plus the whole TTL of the level it was found in; it arrives up
// to that level's TTL (2^n grains) late, never early. The put-back copy
// carries DueHeader from then on.
//
// Which messages are counted: Census reads, per level, the number of
// messages the level held when its turn came (passive queue.declare), and
// stops at the first message it put back itself (CensusHeader = this run's
// id; it leaves that one in the queue): the queue is FIFO, so it has then
// gone round. On a quiescent cascade the counts are exact. On a
// live one they are not a snapshot: a message that moves to a lower level
// before that level's turn is counted there (once), one that moves to a
// level already read is not counted; none is lost or counted twice.
//
// cfg supplies the connection like NewPublisher (Publisher or URI). It
// returns the report so far and the first error: Validate's, an invalid
// option (a level out of range, a bad or circular Move), a declare or bind
// error (*amqpretry.DeclareError, e.g. 404 for a missing new destination),
// a put-back transaction's error (its messages are either put back or
// still in their level queue), a failed reroute of an unroutable copy, or
// ctx's (Census stops taking messages, commits nothing more, and returns
// what it holds, see above).
func Census(ctx context.Context, cfg Config, opts CensusOptions) (CensusReport, error) {
	rep := CensusReport{Started: time.Now()}
	c, err := newCore(cfg)
	if err != nil {
		return rep, err
	}
	defer c.close()
	cfg = c.cfg
	levels, err := opts.levels(&cfg)
	if err != nil {
		return rep, err
	}
	for from, to := range opts.Move {
		if err := cfg.checkQueue(from); err != nil {
			return rep, fmt.Errorf("cascade.CensusOptions.Move: from: %w", err)
		}
		if err := cfg.checkQueue(to); err != nil {
			return rep, fmt.Errorf("cascade.CensusOptions.Move: to: %w", err)
		}
		if from == to {
			return rep, fmt.Errorf("cascade.CensusOptions.Move: %q is moved to itself", from)
		}
	}
	if !opts.DryRun {
		for _, to := range opts.Move {
			if err := c.bind(to); err != nil {
				return rep, fmt.Errorf("cascade: binding the new destination %q: %w", to, err)
			}
		}
	}
	concurrency := opts.Concurrency
	if concurrency <= 0 {
		concurrency = 128
	}
	run := censusRun{c: c, opts: opts, id: newRunID(), rep: &rep, size: concurrency,
		entries: map[levelQueue]*CensusEntry{}}
	for _, n := range levels {
		if err = run.level(ctx, n); err != nil {
			break
		}
	}
	run.finish()
	rep.Finished = time.Now()
	return rep, err
}

// levels returns the levels to read, top first.
func (o *CensusOptions) levels(cfg *Config) ([]int, error) {
	var out []int
	if len(o.Levels) == 0 {
		for n := cfg.Levels - 1; n >= 0; n-- {
			out = append(out, n)
		}
		return out, nil
	}
	seen := map[int]bool{}
	for _, n := range o.Levels {
		if n < 0 || n >= cfg.Levels {
			return nil, fmt.Errorf("cascade.CensusOptions.Levels: level %d is outside [0, %d]", n, cfg.Levels-1)
		}
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	sort.Sort(sort.Reverse(sort.IntSlice(out)))
	return out, nil
}

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
	cfg := &r.c.cfg
	ch, err := r.c.pub.Channel()
	if err != nil {
		return err
	}
	var abandoned atomic.Bool
	// call runs a broker round trip on ch; once ctx has ended it waits
	// censusGrace more, then abandons ch (see abandon) and returns.
	call := func(f func() error) error {
		done := make(chan error, 1)
		go func() { done <- f() }()
		select {
		case err := <-done:
			return err
		case <-ctx.Done():
		}
		select {
		case err := <-done:
			return err
		case <-time.After(censusGrace):
			abandoned.Store(true)
			return errAbandoned
		}
	}
	defer func() {
		if abandoned.Load() {
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
	}()
	var q amqp.Queue
	if err := call(func() (err error) {
		q, err = ch.QueueDeclarePassive(cfg.LevelName(n), true, false, false, false, cfg.levelArgs(n))
		return err
	}); err != nil {
		return fmt.Errorf("cascade: inspecting level queue %q: %w", cfg.LevelName(n), err)
	}
	if q.Messages == 0 {
		return nil
	}
	if err := call(func() error { return ch.Qos(r.size, 0, false) }); err != nil {
		return fmt.Errorf("cascade: setting the prefetch on %q: %w", q.Name, err)
	}
	if err := call(ch.Tx); err != nil {
		return fmt.Errorf("cascade: selecting transactions on %q: %w", q.Name, err)
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, r.size+1))
	tag := "rabbitretry-census-" + r.id
	var ds <-chan amqp.Delivery
	if err := call(func() (err error) {
		ds, err = ch.Consume(q.Name, tag, false, false, false, false, nil)
		return err
	}); err != nil {
		return fmt.Errorf("cascade: consuming %q: %w", q.Name, err)
	}
	taken := 0
	stop := false
	var stopErr error
	for !stop {
		var batch []amqp.Delivery
		idle := time.NewTimer(200 * time.Millisecond)
	collect:
		for len(batch) < r.size && taken+len(batch) < q.Messages {
			select {
			case d, open := <-ds:
				if !open {
					stop, stopErr = true, fmt.Errorf("cascade: the census consumer on %q ended (channel closed): the messages it held go back to the level queue", q.Name)
					break collect
				}
				if d.Headers[CensusHeader] == r.id {
					r.rep.Returned++ // gone round: left to the cancel, which returns it
					stop = true
					break collect
				}
				batch = append(batch, d)
				idle.Reset(50 * time.Millisecond) // Go 1.23+: no stale tick survives a Reset
			case <-idle.C:
				if len(batch) > 0 {
					break collect // commit what came; more may follow
				}
				var st amqp.Queue
				if err := call(func() (err error) {
					st, err = ch.QueueDeclarePassive(q.Name, true, false, false, false, cfg.levelArgs(n))
					return err
				}); err != nil || st.Messages == 0 {
					stop = true // empty: the rest moved to a lower level meanwhile
					stopErr = err
					break collect
				}
				idle.Reset(200 * time.Millisecond)
			case <-ctx.Done():
				stop = true
				break collect
			}
		}
		idle.Stop()
		if ctx.Err() != nil {
			// Interrupted: the batch is not put back; the cancel or the
			// channel's close returns it, untouched.
			r.rep.Returned += len(batch)
			stop = true
			break
		}
		if len(batch) == 0 {
			break
		}
		taken += len(batch)
		if err := r.commit(ch, call, n, batch, returns); err != nil {
			return err
		}
		if taken >= q.Messages {
			stop = true
		}
	}
	if stopErr != nil {
		return stopErr
	}
	if err := call(func() error { return ch.Cancel(tag, false) }); err != nil {
		return fmt.Errorf("cascade: cancelling the census consumer on %q: %w", q.Name, err)
	}
	extra := 0
	for range ds { // sent before the cancel: returned by the broker, not put back
		extra++
	}
	r.rep.Returned += extra
	return ctx.Err()
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
// remaining delay is DueHeader − now, clamped to what level n and the key's
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
	c.p.Headers[CensusHeader] = r.id
	bits, queue, perr := cfg.parseKey(d.RoutingKey)
	if perr != nil {
		// Not a cascade key: back into the same level queue, unchanged.
		c.exchange, c.key = "", cfg.LevelName(n)
		return c
	}
	c.ok, c.dest = true, queue
	low := time.Duration(bits&(uint64(1)<<uint(n)-1)) * cfg.Grain
	earliest, latest := now.Add(low), now.Add(low+levelTTL(cfg.Grain, n))
	due, ok := parseDue(c.p.Headers[DueHeader])
	switch {
	case !ok:
		c.noDue, due = true, latest
	case due.After(latest):
		c.clamped, due = true, latest
	case due.Before(earliest):
		c.clamped, due = true, earliest
	}
	c.due = due
	c.p.Headers[DueHeader] = formatDue(due)
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

// formatDue writes a DueHeader value: Unix milliseconds, decimal.
func formatDue(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// parseDue reads a DueHeader value (a decimal string, or an integer if a
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

// ErrSameQueue is returned by Redirect and Unredirect when from and to are
// the same queue.
var ErrSameQueue = errors.New("cascade: redirecting a queue to itself")

// Redirect makes messages addressed to from arrive at to instead, without
// touching them: it binds to to the delivery exchange with from's key
// pattern ("*." × Levels + from) and then removes from's own binding
// (UnbindDestination). Messages keep waiting in their level queues and
// arrive at to on time; messages published for from later do too. The
// binding is on the broker, so it holds for every publisher.
//
// When to use which, for decommissioning a queue from:
//
//   - Redirect: instant (two binding operations), whatever the number of
//     waiting messages, and nothing is taken out of the cascade. But
//     anything that binds from again (a Delayer or Publisher still
//     publishing to from, which binds each destination once per process;
//     amqpretry.New's topology builder, on every subscriber reconnect)
//     makes from's messages arrive at both queues. Stop from's services
//     first; undo with Unredirect(ch, from, to) (rebinds from, then
//     unbinds to).
//   - Census with CensusOptions.Move: rewrites each waiting message's
//     key, so it no longer depends on bindings at all; costs a take-out
//     and a confirmed publish per message in the cascade (all
//     destinations' messages are taken out and put back), and messages
//     published for from afterwards still go to from.
//
// Both queues must exist. It returns Validate's error, ErrBadQueueName
// (wrapped), ErrSameQueue, or an *amqpretry.DeclareError (Kind "binding";
// 404 NOT_FOUND for a missing queue, which closes ch). If the unbind
// fails, to is already bound: messages then reach both queues.
func (c Config) Redirect(ch *amqp.Channel, from, to string) error {
	return c.moveBinding(ch, from, to, to, from)
}

// Unredirect undoes Redirect(from, to): it binds from again with its own
// key pattern ("*." × Levels + from, BindDestination) and then removes
// to's binding of that pattern, so from's waiting messages arrive at from
// again, on time. In that order: between the two operations a message
// leaving level 0 reaches both queues (a duplicate, at worst); the reverse
// order would leave from's messages unroutable meanwhile, and quorum level
// queues would hold them for the dead-letter worker's resend interval
// (minutes late; see the package doc). to's own binding (its own key
// pattern) is untouched. Both queues must exist.
//
// It returns Validate's error, ErrBadQueueName (wrapped), ErrSameQueue, or
// an *amqpretry.DeclareError (Kind "binding"; 404 NOT_FOUND for a missing
// queue, which closes ch). If the unbind fails, from is already bound
// again: messages then reach both queues until it is retried.
func (c Config) Unredirect(ch *amqp.Channel, from, to string) error {
	return c.moveBinding(ch, from, to, from, to)
}

// moveBinding checks from and to, then binds bind and unbinds unbind with
// from's delivery pattern, in that order (Redirect: to then from;
// Unredirect: from then to).
func (c Config) moveBinding(ch *amqp.Channel, from, to, bind, unbind string) error {
	c, err := c.resolved()
	if err != nil {
		return err
	}
	if err := c.checkQueue(from); err != nil {
		return err
	}
	if err := c.checkQueue(to); err != nil {
		return err
	}
	if from == to {
		return fmt.Errorf("%w: %q", ErrSameQueue, from)
	}
	if err := ch.QueueBind(bind, c.destinationPattern(from), c.DeliveryExchange(), false, nil); err != nil {
		return declareError("binding", bind, err)
	}
	if err := ch.QueueUnbind(unbind, c.destinationPattern(from), c.DeliveryExchange(), nil); err != nil {
		return declareError("binding", unbind, err)
	}
	return nil
}
