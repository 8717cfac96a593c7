package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/confirm"
)

// A level queue with a length limit (a policy's max-length or
// max-length-bytes, "Queue Length Limit") refuses messages once full:
// quorum levels overflow with reject-publish (required by at-least-once
// dead-lettering), so a publish into it is nacked, and dead-lettering into
// it from the level above is refused and left in that level's dead-letter
// buffer. This file is how a Delayer or Publisher copes: it holds a refused
// message and publishes it again with what is left of its delay
// (holdRefused), remembers which levels refused (fullLevels, shown by
// Waiting) and, with the management API, reports dead-letter backlogs held
// up by a full level (core.checkBacklogs).

// fullLevels is what a core knows about full levels.
type fullLevels struct {
	mu sync.Mutex
	// limit: the levels that refused a publish and have not shown room
	// since, with their ready count when they refused (the length limit as
	// seen over AMQP); 0 when that count could not be read.
	limit map[int]int
	// refused counts the publishes each level refused since the start.
	refused map[int]int
	// stalled: checkBacklogs reported a backlog behind a full level.
	stalled bool
}

// entryLevel is the level whose exchange a key of n > 0 grains enters
// (EntryExchange).
func entryLevel(n uint64) int { return bits.Len64(n) - 1 }

// holdRefused handles a publish of n grains (n > 0, due at due) that level
// entryLevel(n) refused with refusal (a nack): unless Config.FullWait is
// negative, it keeps the message and publishes it again. A message due
// within FullWait is published at due, straight to the destination (the
// delivery exchange; the destination was bound by send); another one after
// 100 ms, then at doubling pauses up to 1 s, each time with the delay left
// until due (rounded up to the grain: never early), which may enter a
// lower level; if a publish straight to the destination is refused (its
// own length limit), again at those pauses.
// It returns nil once the broker confirmed a copy, the last refusal after
// Config.FullWait, another publish error, or ctx's error. refusal nil:
// send held the message without publishing it (pathFull).
func (c *core) holdRefused(ctx context.Context, p amqp.Publishing, n uint64, due time.Time, queue string, refusal error) error {
	level := entryLevel(n)
	if refusal != nil {
		c.noteRefused(level)
	} else {
		refusal = fmt.Errorf("%w (not sent: a level on its way is full)", confirm.ErrNacked)
	}
	if c.cfg.FullWait < 0 {
		return c.fullError(level, 0, refusal)
	}
	start := time.Now()
	giveUp := start.Add(c.cfg.FullWait)
	// Due within FullWait: wait for the due time and publish straight to
	// the destination, adding nothing to the (full) levels; a copy sent
	// through several levels could be refused again between two of them,
	// where it would wait minutes (see checkBacklogs).
	direct := !due.After(giveUp)
	pause := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		wake := time.Now().Add(pause)
		if due.Before(wake) || (direct && time.Now().Before(due)) {
			wake = due
		}
		if giveUp.Before(wake) {
			wake = giveUp
		}
		if err := sleepUntil(ctx, wake); err != nil {
			return errors.Join(c.fullError(level, time.Since(start), refusal), err)
		}
		m, _ := c.cfg.grains(time.Until(due))
		key, err := c.cfg.routingKey(m, queue)
		if err != nil {
			return err
		}
		err = c.pub.PublishRaw(ctx, c.cfg.EntryExchange(m), key, p)
		if err == nil {
			if m > 0 {
				c.admitted(entryLevel(m))
			}
			c.cfg.Logger.Info("Delay cascade: a message a full level refused is accepted now", watermill.LogFields{
				"queue": queue, "held": time.Since(start).Round(time.Millisecond).String(), "attempts": attempt,
				"left": max(time.Until(due), 0).Round(time.Millisecond).String(), "grains": m})
			return nil
		}
		if !errors.Is(err, confirm.ErrNacked) {
			return err
		}
		refusal = err
		if m > 0 {
			level = entryLevel(m)
			c.noteRefused(level)
		}
		if !time.Now().Before(giveUp) {
			return c.fullError(level, time.Since(start), refusal)
		}
		pause = min(2*pause, time.Second)
	}
}

// sleepUntil waits until t or ctx's end (its error).
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// fullError is the error Schedule and Publish return for a message the
// cascade kept refusing.
func (c *core) fullError(level int, held time.Duration, refusal error) error {
	return fmt.Errorf("cascade: level queue %q refused the message (full: a length limit on the level queues?), held %v (Config.FullWait %v): %w",
		c.cfg.LevelName(level), held.Round(time.Millisecond), c.cfg.FullWait, refusal)
}

// noteRefused counts a refusal by level and, the first time since it last
// had room, marks it full, reads its ready count (the limit as seen over
// AMQP) and logs an error.
func (c *core) noteRefused(level int) {
	f := &c.full
	f.mu.Lock()
	if f.refused == nil {
		f.refused, f.limit = map[int]int{}, map[int]int{}
	}
	f.refused[level]++
	_, known := f.limit[level]
	if !known {
		f.limit[level] = 0
	}
	f.mu.Unlock()
	if known {
		return
	}
	count := -1
	if q, err := c.inspect(level); err == nil {
		count = q.Messages
		f.mu.Lock()
		if _, still := f.limit[level]; still {
			f.limit[level] = q.Messages
		}
		f.mu.Unlock()
	}
	c.cfg.Logger.Error("Delay cascade level queue refused a message: it is full (a length limit from a policy or an operator policy?); "+
		"holding refused messages and publishing them again with what is left of their delay (Config.FullWait). "+
		"Exclude the level queues from length-limit policies", nil, watermill.LogFields{
		"queue": c.cfg.LevelName(level), "ready": count, "full_wait": c.cfg.FullWait.String()})
}

// pathFull reports whether a level marked full (fullLevels) is on the way
// of a key of n grains: one of n's set bits (its entry level, or a level it
// is dead-lettered into later).
func (c *core) pathFull(n uint64) bool {
	c.full.mu.Lock()
	defer c.full.mu.Unlock()
	for level := range c.full.limit {
		if n>>uint(level)&1 == 1 {
			return true
		}
	}
	return false
}

// markAtLimit marks level full from the management API (its count at its
// max-length): it has room again once its ready count is below limit.
func (c *core) markAtLimit(level, limit int) {
	c.full.mu.Lock()
	defer c.full.mu.Unlock()
	if c.full.limit == nil {
		c.full.refused, c.full.limit = map[int]int{}, map[int]int{}
	}
	c.full.limit[level] = limit
}

// admitted records that level accepted a publish: it has room.
func (c *core) admitted(level int) {
	f := &c.full
	f.mu.Lock()
	_, was := f.limit[level]
	delete(f.limit, level)
	f.mu.Unlock()
	if was {
		c.cfg.Logger.Info("Delay cascade level queue accepts messages again", watermill.LogFields{"queue": c.cfg.LevelName(level)})
	}
}

// inspect passively declares level's queue on a channel of its own.
func (c *core) inspect(level int) (amqp.Queue, error) {
	ch, err := c.pub.Channel()
	if err != nil {
		return amqp.Queue{}, err
	}
	defer ch.Close()
	return ch.QueueDeclarePassive(c.cfg.LevelName(level), true, false, false, false, nil)
}

// checkFull is the topology check's look at the levels marked full: one
// whose ready count fell below the count it had when it refused has room
// again.
func (c *core) checkFull() {
	c.full.mu.Lock()
	marked := make(map[int]int, len(c.full.limit))
	for level, limit := range c.full.limit {
		marked[level] = limit
	}
	c.full.mu.Unlock()
	for level, limit := range marked {
		if q, err := c.inspect(level); err == nil && q.Messages < limit {
			c.admitted(level)
		}
	}
}

// markedFull reports level's refusals since the start and whether it is
// marked full.
func (c *core) markedFull(level int) (refused int, full bool) {
	c.full.mu.Lock()
	defer c.full.mu.Unlock()
	_, full = c.full.limit[level]
	return c.full.refused[level], full
}

// checkBacklogs, with the management API's reading stats, marks the
// levels at their max-length full (new messages whose way crosses one are
// held, see send), and logs an error
// once per episode when a level holds a dead-letter backlog while a level
// is at its max-length: its messages were refused by the full level, and
// RabbitMQ's at-least-once dead-letter worker resends a refused message
// only once dead_letter_worker_publisher_confirm_timeout (3 min by
// default) has passed since it last sent it (rabbit_fifo_dlx_worker,
// redeliver_messages); a policy change (nudgeDeadLetterWorkers) does not
// hasten that, it resends only messages that found no route.
func (c *core) checkBacklogs(stats map[string]levelStat) {
	var full, backlog []string
	for n := 0; n < c.cfg.Levels; n++ {
		s := stats[c.cfg.LevelName(n)]
		if s.atLimit() {
			full = append(full, s.Name)
			limit, _ := s.maxLength()
			c.markAtLimit(n, limit)
		}
		if s.MessagesDLX != nil && *s.MessagesDLX > 0 {
			backlog = append(backlog, fmt.Sprintf("%s=%d", s.Name, *s.MessagesDLX))
		}
	}
	stalled := len(full) > 0 && len(backlog) > 0
	c.full.mu.Lock()
	report := stalled && !c.full.stalled
	c.full.stalled = stalled
	c.full.mu.Unlock()
	if report {
		c.cfg.Logger.Error("Delay cascade: messages wait in a level's dead-letter buffer because a full level refused them; "+
			"RabbitMQ resends them after dead_letter_worker_publisher_confirm_timeout (3 min by default): they arrive that late. "+
			"Remove the length limit from the level queues", nil, watermill.LogFields{
			"full": strings.Join(full, " "), "dead_lettering": strings.Join(backlog, " ")})
	}
}
