package cascadecore

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// TestTopologyDeletedWhileWaiting (#18.9c): an operator deletes a piece of
// the cascade while messages wait in a level above it. 10 messages are
// scheduled 4.8 s ahead (bits 5 and 4: 3.2 s in level 5, then 1.6 s in
// level 4); right after their confirms, level 4's queue (case "level
// queue") or the delivery exchange (case "delivery exchange", which takes
// level 0's binding to it and every destination binding with it) is
// deleted. Nobody publishes again. Without a topology check the messages
// leave level 5 at 3.2 s into the gap: RabbitMQ's at-least-once
// dead-letter worker keeps them in level 5's dead-letter buffer and retries
// every 3 minutes, so none arrives in time (and none at all while the gap
// stays). With TopologyCheck (500 ms here) the Delayer redeclares the
// cascade and rebinds its destination before they expire: all arrive, none
// early, none late.
func TestTopologyDeletedWhileWaiting(t *testing.T) {
	for _, tc := range []struct {
		name   string
		delete func(ch *amqp.Channel, cfg Config) error
	}{
		{"level queue", func(ch *amqp.Channel, cfg Config) error {
			_, err := ch.QueueDelete(cfg.LevelName(4), false, false, false)
			return err
		}},
		{"delivery exchange", func(ch *amqp.Channel, cfg Config) error {
			return ch.ExchangeDelete(cfg.DeliveryExchange(), false, false)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Config{Levels: 8, QueueName: queueFromCtx, TopologyCheck: 500 * time.Millisecond})
			q := f.cfg.Prefix + ".dest"
			arrivals := f.queue(q)
			d := f.delayer(q)

			const published = 10
			const delay = 4800 * time.Millisecond
			sent := time.Now()
			for i := range published {
				if err := d.Schedule(queueCtx(q), message.NewMessage(fmt.Sprint(i), nil), delay); err != nil {
					t.Fatal(err)
				}
			}
			if err := tc.delete(f.channel(), f.cfg); err != nil {
				t.Fatalf("deleting the %s: %v", tc.name, err)
			}

			seen := map[string]int{}
			var early, late, duplicates int
			levels := popcount(uint64(delay / d.config().Grain))
			deadline := time.After(delay + 6*time.Second)
		wait:
			for len(seen) < published {
				select {
				case a := <-arrivals:
					seen[a.msg.UUID]++
					if seen[a.msg.UUID] > 1 {
						duplicates++
					}
					switch errd := a.at.Sub(sent) - delay; {
					case errd < -time.Duration(levels+1)*earlyPerLevel:
						early++
					case errd > lateTolerance:
						late++
					}
				case <-deadline:
					break wait
				}
			}
			lost := published - len(seen)
			t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), published, len(seen), duplicates, lost)
			t.Logf("%s: early=%d late=%d (late: more than %v after the delay; lost: not arrived %v after it)", t.Name(), early, late, lateTolerance, 6*time.Second)
			if lost > 0 || early > 0 || late > 0 || duplicates > 0 {
				t.Errorf("after deleting the %s: lost %d, early %d, late %d, duplicates %d; want 0", tc.name, lost, early, late, duplicates)
			}
		})
	}
}

// TestWaitingCountsDeadLetterBacklog: with level 1's queue deleted and no
// topology check, 3 messages scheduled 600 ms ahead (levels 2 and 1) expire
// out of level 2 into the gap and stay in its dead-letter buffer. Their
// ready counts are 0 everywhere; with ManagementURL, Waiting shows them as
// level 2's DeadLettering.
func TestWaitingCountsDeadLetterBacklog(t *testing.T) {
	mgmt := testkit.HaveMgmt(t)
	f := newFixture(t, Config{Levels: 3, QueueName: queueFromCtx, TopologyCheck: -1, ManagementURL: mgmt})
	q := f.cfg.Prefix + ".dest"
	f.queue(q)
	d := f.delayer(q)
	if _, err := f.channel().QueueDelete(f.cfg.LevelName(1), false, false, false); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := d.Schedule(queueCtx(q), message.NewMessage(fmt.Sprint(i), nil), 600*time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	// Once they left level 2 (into its dead-letter buffer), put level 1
	// back (Waiting needs every level queue): the buffered messages stay
	// buffered until the dead-letter worker's next retry, minutes away.
	probe := f.channel()
	testkit.WaitFor(t, 10*time.Second, "level 2 to expire its messages", func() bool {
		q, err := probe.QueueDeclarePassive(f.cfg.LevelName(2), true, false, false, false, nil)
		if err != nil {
			t.Fatalf("level 2: %v", err)
		}
		return q.Messages == 0
	})
	if err := f.cfg.Declare(f.channel()); err != nil {
		t.Fatal(err)
	}
	var counts []LevelCount
	testkit.WaitFor(t, 30*time.Second, "level 2's dead-letter backlog of 3 in Waiting", func() bool {
		var err error
		counts, err = d.Waiting(context.Background())
		if err != nil {
			t.Fatalf("Waiting: %v", err)
		}
		return counts[2].DeadLettering == 3
	})
	for _, c := range counts {
		t.Logf("level %d: messages %d, dead-lettering %d, length limit %q", c.Level, c.Messages, c.DeadLettering, c.LengthLimit)
		if c.Messages != 0 || c.LengthLimit != "" {
			t.Errorf("level %d: messages %d, length limit %q; want 0 and none", c.Level, c.Messages, c.LengthLimit)
		}
	}
	if counts, err := delayerWithoutManagement(t, f).Waiting(context.Background()); err != nil || counts[2].DeadLettering != -1 {
		t.Errorf("without ManagementURL: DeadLettering %v, %v; want -1", counts, err)
	}
}

func delayerWithoutManagement(t *testing.T, f *fixture) *Delayer {
	cfg := f.cfg
	cfg.ManagementURL = ""
	d, err := NewDelayer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

// TestRepairDrainsDeadLetterBacklog: level 1's queue is deleted before 5
// messages are scheduled 600 ms ahead (levels 2 and 1), so all 5 expire
// out of level 2 (400 ms) into the gap, before the topology check (every
// 2 s) repairs it: they sit in level 2's dead-letter buffer, which
// RabbitMQ's worker resends every 3 minutes. With ManagementURL the repair
// has the workers resend at once (a policy applied and removed): all 5
// arrive within the check interval plus the tolerance of their due time.
func TestRepairDrainsDeadLetterBacklog(t *testing.T) {
	mgmt := testkit.HaveMgmt(t)
	if os.Getenv("RABBITRETRY_NUDGE_OFF") != "" { // measure the "before" by hand
		mgmt = ""
	}
	const check = 2 * time.Second
	f := newFixture(t, Config{Levels: 3, QueueName: queueFromCtx, TopologyCheck: check, ManagementURL: mgmt})
	q := f.cfg.Prefix + ".dest"
	arrivals := f.queue(q)
	d := f.delayer(q)
	if _, err := f.channel().QueueDelete(f.cfg.LevelName(1), false, false, false); err != nil {
		t.Fatal(err)
	}
	const published = 5
	const delay = 600 * time.Millisecond
	sent := time.Now()
	for i := range published {
		if err := d.Schedule(queueCtx(q), message.NewMessage(fmt.Sprint(i), nil), delay); err != nil {
			t.Fatal(err)
		}
	}
	seen := map[string]int{}
	var early, late, duplicates int
	var worst time.Duration
	deadline := time.After(delay + check + 8*time.Second)
wait:
	for len(seen) < published {
		select {
		case a := <-arrivals:
			seen[a.msg.UUID]++
			if seen[a.msg.UUID] > 1 {
				duplicates++
			}
			errd := a.at.Sub(sent) - delay
			worst = max(worst, errd)
			switch {
			case errd < -3*earlyPerLevel:
				early++
			case errd > check+lateTolerance:
				late++
			}
		case <-deadline:
			break wait
		}
	}
	lost := published - len(seen)
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), published, len(seen), duplicates, lost)
	t.Logf("%s: early=%d late=%d worst=%v (late: more than %v after the delay; lost: not arrived %v after it)",
		t.Name(), early, late, worst.Round(time.Millisecond), check+lateTolerance, check+8*time.Second)
	if lost > 0 || early > 0 || late > 0 || duplicates > 0 {
		t.Errorf("lost %d, early %d, late %d, duplicates %d; want 0", lost, early, late, duplicates)
	}
}
