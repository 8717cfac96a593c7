package cascadecore

import (
	"context"
	"fmt"
	"sort"
	"time"
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
	// EarliestDue and LatestDue bound their due times (header rabbitretry-cascade-due, or the
	// estimate Census used for messages without one).
	EarliestDue time.Time `json:"earliest_due"`
	LatestDue   time.Time `json:"latest_due"`
	// NoDueHeader counts those without header rabbitretry-cascade-due (published by an older
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
	// Clamped is the number of counted messages whose header rabbitretry-cascade-due lay outside
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
// both are in each message's routing key and header rabbitretry-cascade-due, readable only by
// taking the message. Use Waiting for per-level counts without
// disturbing anything.
//
// How a message is put back: its remaining delay is due − now (header rabbitretry-cascade-due),
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
// (levelDeliveryLimit, 2^31-1) is never reached, so no number of
// interrupted censuses moves a message on early. (Level queues declared by
// an earlier version without x-delivery-limit have the broker's default,
// 20 on 4.x: recreate them, see the README.) While a message is held it
// does not expire; its copy has its remaining delay, so the hold costs no
// lateness, except when an alarm delays a commit: the copies then enter
// the cascade when the alarm clears, with the delay computed before it.
//
// Timing: a message is exact to the grain plus the time it was held
// (milliseconds) when it carries header rabbitretry-cascade-due (the Delayer and Publisher stamp
// it). One without it (published by a version before header rabbitretry-cascade-due) is put
// back with the largest delay it can have left: the lower levels' bits of
// its key plus the whole TTL of the level it was found in; it arrives up
// to that level's TTL (2^n grains) late, never early. The put-back copy
// carries header rabbitretry-cascade-due from then on.
//
// Which messages are counted: Census reads, per level, the number of
// messages the level held when its turn came (passive queue.declare), and
// stops at the first message it put back itself (header rabbitretry-cascade-census = this run's
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
