package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// setLevelPolicy applies an operator's policy with definition def to the
// level queues of f's cascade whose names match suffix (a regexp after
// "<Prefix>.level."), cleared in t.Cleanup.
func setLevelPolicy(t *testing.T, f *fixture, name, suffix, def string) (clear func()) {
	t.Helper()
	policy := f.cfg.Prefix + "." + name
	if out, err := testkit.Ctl(t, 60*time.Second, "set_policy", "--apply-to", "queues", "--priority", "100", policy,
		"^"+regexp.QuoteMeta(f.cfg.Prefix)+`\.level\.`+suffix, def); err != nil {
		t.Fatalf("set_policy: %v %s", err, out)
	}
	var once sync.Once
	clear = func() {
		once.Do(func() {
			if out, err := testkit.Ctl(t, 60*time.Second, "clear_policy", policy); err != nil {
				t.Errorf("clear_policy: %v %s", err, out)
			}
		})
	}
	t.Cleanup(clear)
	return clear
}

// TestLengthLimitPolicyOnLevels (#18.9c): an operator's policy puts
// max-length 2 on every level queue. 6 messages are scheduled 3.2 s ahead
// (level 5 only) from 6 goroutines, 100 ms apart, as handlers failing one
// after another would: the broker takes 2 (3: a quorum queue checks the
// limit before each enqueue, so one more gets in) and refuses the rest
// (x-overflow reject-publish: a nack).
// Before: Schedule returned confirm.ErrNacked for those, and the retry
// middleware nacked the original, which the broker redelivered at once:
// the retry ran 3.2 s early. Must hold: every Schedule returns nil (the
// refused ones are held, being due within Config.FullWait, until their due
// time, and then go straight to the queue); all 6 arrive, none early, none
// late; Waiting shows level 5 full and its refusals while they are held,
// and room again once the level emptied, with and without the management
// API; with it, the topology check logs the limit.
func TestLengthLimitPolicyOnLevels(t *testing.T) {
	testkit.HaveCtl(t)
	for _, withMgmt := range []bool{false, true} {
		t.Run(fmt.Sprintf("management=%v", withMgmt), func(t *testing.T) {
			mgmt := ""
			if withMgmt {
				mgmt = testkit.HaveMgmt(t)
			}
			var logs testkit.SyncBuffer
			f := newFixture(t, Config{Levels: 8, QueueName: queueFromCtx, TopologyCheck: 200 * time.Millisecond, ManagementURL: mgmt,
				Logger: watermill.NewStdLoggerWithOut(&logs, false, false)})
			q := f.cfg.Prefix + ".dest"
			arrivals := f.queue(q)
			d := f.delayer(q)
			setLevelPolicy(t, f, "maxlen", "", `{"max-length":2}`)
			// The policy is in force once a third message is refused; wait
			// for it with probes to level 5's queue (default exchange).
			probe := f.channel()
			if err := probe.Confirm(false); err != nil {
				t.Fatal(err)
			}
			testkit.WaitFor(t, 20*time.Second, "the policy on the level queues", func() bool {
				_, _ = probe.QueuePurge(f.cfg.LevelName(5), false)
				for range 5 {
					c, err := probe.PublishWithDeferredConfirm("", f.cfg.LevelName(5), false, false, amqp.Publishing{Body: []byte("probe")})
					if err != nil {
						t.Fatal(err)
					}
					if !c.Wait() {
						_, _ = probe.QueuePurge(f.cfg.LevelName(5), false)
						return true
					}
				}
				return false
			})

			const published = 6
			const delay = 3200 * time.Millisecond
			type result struct {
				id   string
				sent time.Time
				err  error
				took time.Duration
			}
			results := make(chan result, published)
			for i := range published {
				go func() {
					msg := message.NewMessage(fmt.Sprint(i), nil)
					sent := time.Now()
					err := d.Schedule(queueCtx(q), msg, delay)
					results <- result{msg.UUID, sent, err, time.Since(sent)}
				}()
				// A quorum queue tells the channel it is full after the
				// enqueue that filled it: publishes already on their way
				// get in. Space them as handlers failing one after another.
				time.Sleep(100 * time.Millisecond)
			}
			// The refused ones are held now (due within FullWait: until
			// their due time).
			counts, err := d.Waiting(context.Background())
			if err != nil {
				t.Fatalf("Waiting: %v", err)
			}
			t.Logf("while held: level 5: messages %d, full %v, refused %d", counts[5].Messages, counts[5].Full, counts[5].Refused)
			// Refused: at least the first refusal; once level 5 is marked
			// full, the Delayer holds the next ones without publishing.
			if counts[5].Refused < 1 || !counts[5].Full {
				t.Errorf("Waiting while held: level 5 refused %d publishes, full %v; want at least 1 and true", counts[5].Refused, counts[5].Full)
			}
			sent := map[string]time.Time{}
			var failed int
			var longest time.Duration
			for range published {
				r := <-results
				if r.err != nil {
					failed++
					t.Errorf("Schedule: %v", r.err)
					continue
				}
				sent[r.id] = r.sent
				longest = max(longest, r.took)
			}
			t.Logf("longest Schedule (held) %v", longest.Round(time.Millisecond))
			testkit.WaitFor(t, 10*time.Second, "Waiting to show level 5 with room again", func() bool {
				counts, err := d.Waiting(context.Background())
				return err == nil && !counts[5].Full
			})
			if withMgmt { // the management API's figures are up to ~5 s old
				testkit.WaitFor(t, 20*time.Second, "Waiting to show level 5's length limit", func() bool {
					counts, err := d.Waiting(context.Background())
					return err == nil && counts[5].LengthLimit == "max-length=2"
				})
			}

			seen := map[string]int{}
			var early, late, duplicates int
			var worst time.Duration
			deadline := time.After(delay + 8*time.Second)
		wait:
			for len(seen) < len(sent) {
				select {
				case a := <-arrivals:
					seen[a.msg.UUID]++
					if seen[a.msg.UUID] > 1 {
						duplicates++
					}
					errd := a.at.Sub(sent[a.msg.UUID]) - delay
					worst = max(worst, errd)
					switch {
					case errd < -2*earlyPerLevel:
						early++
					case errd > lateTolerance:
						late++
					}
				case <-deadline:
					break wait
				}
			}
			lost := published - failed - len(seen)
			t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), published, len(seen), duplicates, lost)
			t.Logf("%s: not scheduled=%d early=%d late=%d worst=%v (late: more than %v after the delay)", t.Name(), failed, early, late, worst.Round(time.Millisecond), lateTolerance)
			if failed != 0 || lost != 0 || early != 0 || late != 0 || duplicates != 0 {
				t.Errorf("not scheduled %d lost %d early %d late %d duplicates %d; want 0", failed, lost, early, late, duplicates)
			}
			if !strings.Contains(logs.String(), "refused a message: it is full") {
				t.Errorf("no error logged for the full level; logs:\n%s", logs.String())
			}
			if withMgmt {
				testkit.WaitFor(t, 10*time.Second, "the topology check's length limit error", func() bool {
					return strings.Contains(logs.String(), "has a length limit") && strings.Contains(logs.String(), "max-length=2")
				})
			}
		})
	}
}

// TestFullLevelStallReported (#18.9c): a full level refuses dead-lettering
// from the level above, and RabbitMQ's at-least-once dead-letter worker
// keeps the refused messages in its buffer and resends them only after
// its confirm timeout (dead_letter_worker_publisher_confirm_timeout, 3 min
// by default; rabbit_fifo_dlx_worker:redeliver_messages: a refused message
// is resent once that long has passed since it was last sent, and a policy
// change does not hasten it). An operator's policy max-length 2 on level
// 4, and a filler publishing into level 4 every 20 ms, keep it full. 3
// messages scheduled 4.8 s ahead (levels 5 and 4) enter level 5 and
// expire out of it at 3.2 s into the full level 4. Must hold, with
// ManagementURL: within seconds Waiting shows level 5's dead-letter backlog
// and level 4 full, and the topology check logs why they will be late.
// (Their delivery, about 3 minutes late, is not waited for here.)
func TestFullLevelStallReported(t *testing.T) {
	testkit.HaveCtl(t)
	mgmt := testkit.HaveMgmt(t)
	var logs testkit.SyncBuffer
	// FullWait negative: no hold, so the messages enter the cascade even
	// if the check saw level 4 full first (TestFullLevelAvoided).
	f := newFixture(t, Config{Levels: 8, QueueName: queueFromCtx, TopologyCheck: 500 * time.Millisecond, ManagementURL: mgmt,
		FullWait: -1, Logger: watermill.NewStdLoggerWithOut(&logs, false, false)})
	q := f.cfg.Prefix + ".dest"
	f.queue(q)
	d := f.delayer(q)
	setLevelPolicy(t, f, "full", `04$`, `{"max-length":2}`)
	probe := f.channel()
	if err := probe.Confirm(false); err != nil {
		t.Fatal(err)
	}
	fillKey, err := f.cfg.RoutingKey(1600*time.Millisecond, q) // level 4 only
	if err != nil {
		t.Fatal(err)
	}
	fill := func() bool { // true: refused
		c, err := probe.PublishWithDeferredConfirm(f.cfg.LevelName(4), fillKey, false, false, amqp.Publishing{Body: []byte("filler")})
		if err != nil {
			t.Fatal(err)
		}
		return !c.Wait()
	}
	testkit.WaitFor(t, 20*time.Second, "the policy on level 4", func() bool {
		for range 5 {
			if fill() {
				return true
			}
		}
		return false
	})

	const published = 3
	for i := range published {
		if err := d.Schedule(queueCtx(q), message.NewMessage(fmt.Sprint(i), nil), 4800*time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	var counts []LevelCount
	const reported = "because a full level refused them"
	for {
		fill()
		time.Sleep(20 * time.Millisecond)
		if strings.Contains(logs.String(), reported) {
			break
		}
		// The stall lasts the dead-letter worker's 3 min. The report needs
		// one management sample (every 5 s) that shows level 4 at its limit,
		// which it leaves for a moment each time a filler message expires:
		// a loaded machine misses samples (seen: not within 25 s).
		if time.Since(start) > 60*time.Second {
			t.Fatalf("no report of the stall within 60 s; logs:\n%s", logs.String())
		}
	}
	t.Logf("stall reported %v after scheduling (the messages reached the full level after 3.2 s)", time.Since(start).Round(100*time.Millisecond))
	counts, err = d.Waiting(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("level 5: dead-lettering %d; level 4: messages %d, full %v, length limit %q",
		counts[5].DeadLettering, counts[4].Messages, counts[4].Full, counts[4].LengthLimit)
	if counts[5].DeadLettering < 1 || counts[4].LengthLimit != "max-length=2" {
		t.Errorf("Waiting: level 5 dead-lettering %d, level 4 length limit %q; want >= 1 and max-length=2", counts[5].DeadLettering, counts[4].LengthLimit)
	}
}

// TestFullWaitBounds: with max-length 2 on level 5 only, messages 3.2 s
// ahead that level 5 refuses are, with FullWait 1 s (due after it),
// published again after 100 ms with what is left of their delay (31
// grains: level 4 and below, not full): every Schedule returns within
// about 1 s, all arrive on time. With FullWait negative, a refusal is
// returned at once (wrapping confirm.ErrNacked).
func TestFullWaitBounds(t *testing.T) {
	testkit.HaveCtl(t)
	for _, wait := range []time.Duration{time.Second, -1} {
		t.Run(fmt.Sprintf("FullWait=%v", wait), func(t *testing.T) {
			f := newFixture(t, Config{Levels: 8, QueueName: queueFromCtx, TopologyCheck: 200 * time.Millisecond, FullWait: wait})
			q := f.cfg.Prefix + ".dest"
			arrivals := f.queue(q)
			d := f.delayer(q)
			setLevelPolicy(t, f, "maxlen", `05$`, `{"max-length":2}`)
			probe := f.channel()
			if err := probe.Confirm(false); err != nil {
				t.Fatal(err)
			}
			testkit.WaitFor(t, 20*time.Second, "the policy on level 5", func() bool {
				_, _ = probe.QueuePurge(f.cfg.LevelName(5), false)
				for range 5 {
					c, err := probe.PublishWithDeferredConfirm("", f.cfg.LevelName(5), false, false, amqp.Publishing{Body: []byte("probe")})
					if err != nil {
						t.Fatal(err)
					}
					if !c.Wait() {
						_, _ = probe.QueuePurge(f.cfg.LevelName(5), false)
						return true
					}
				}
				return false
			})
			const published = 6
			const delay = 3200 * time.Millisecond
			sent := map[string]time.Time{}
			var nacked int
			var longest time.Duration
			for i := range published {
				msg := message.NewMessage(fmt.Sprint(i), nil)
				start := time.Now()
				err := d.Schedule(queueCtx(q), msg, delay)
				longest = max(longest, time.Since(start))
				switch {
				case err == nil:
					sent[msg.UUID] = start
				case wait < 0 && errors.Is(err, confirm.ErrNacked):
					nacked++
				default:
					t.Fatalf("Schedule %d: %v", i, err)
				}
			}
			t.Logf("longest Schedule %v, refusals returned %d", longest.Round(time.Millisecond), nacked)
			if wait < 0 && (nacked < 2 || longest > 500*time.Millisecond) {
				t.Errorf("FullWait negative: %d refusals returned, longest Schedule %v; want at least 2, at once", nacked, longest)
			}
			if wait > 0 && longest > wait+500*time.Millisecond {
				t.Errorf("FullWait %v: longest Schedule %v", wait, longest)
			}
			seen := map[string]int{}
			var early, late, duplicates int
			deadline := time.After(delay + 6*time.Second)
		wait:
			for len(seen) < len(sent) {
				select {
				case a := <-arrivals:
					seen[a.msg.UUID]++
					if seen[a.msg.UUID] > 1 {
						duplicates++
					}
					switch errd := a.at.Sub(sent[a.msg.UUID]) - delay; {
					case errd < -6*earlyPerLevel:
						early++
					case errd > lateTolerance:
						late++
					}
				case <-deadline:
					break wait
				}
			}
			lost := len(sent) - len(seen)
			t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d (refused to the caller: %d)", t.Name(), published, len(seen), duplicates, lost, nacked)
			if lost != 0 || early != 0 || late != 0 || duplicates != 0 || len(sent)+nacked != published {
				t.Errorf("lost %d early %d late %d duplicates %d; want 0", lost, early, late, duplicates)
			}
		})
	}
}

// TestFullLevelAvoided (#18.9c): as TestFullLevelStallReported, level 4
// kept full (policy max-length 2, a filler publishing into it every
// 20 ms), but the 3 messages 4.8 s ahead (levels 5 and 4) are scheduled
// once the topology check has seen level 4 at its max-length (management
// API). Before: they entered level 5 and, refused by level 4 at 3.2 s,
// waited in level 5's dead-letter buffer for minutes (0 of 3 within 20 s,
// TestFullLevelStallReported's setup on 7eef105). Must hold: the Delayer
// holds them (due within FullWait) and publishes them at their due time
// straight to the queue: all 3 on time, none early, none lost.
func TestFullLevelAvoided(t *testing.T) {
	testkit.HaveCtl(t)
	mgmt := testkit.HaveMgmt(t)
	f := newFixture(t, Config{Levels: 8, QueueName: queueFromCtx, TopologyCheck: 500 * time.Millisecond, ManagementURL: mgmt})
	q := f.cfg.Prefix + ".dest"
	arrivals := f.queue(q)
	d := f.delayer(q)
	setLevelPolicy(t, f, "full", `04$`, `{"max-length":2}`)
	probe := f.channel()
	if err := probe.Confirm(false); err != nil {
		t.Fatal(err)
	}
	fillKey, err := f.cfg.RoutingKey(1600*time.Millisecond, q) // level 4 only
	if err != nil {
		t.Fatal(err)
	}
	fill := func() {
		c, err := probe.PublishWithDeferredConfirm(f.cfg.LevelName(4), fillKey, false, false, amqp.Publishing{Body: []byte("filler")})
		if err != nil {
			t.Fatal(err)
		}
		c.Wait()
	}
	start := time.Now()
	for !d.c.pathFull(1 << 4) {
		fill()
		time.Sleep(20 * time.Millisecond)
		if time.Since(start) > 30*time.Second {
			t.Fatal("the topology check did not mark level 4 full within 30 s")
		}
	}
	t.Logf("level 4 marked full %v after the filler started", time.Since(start).Round(100*time.Millisecond))

	const published = 3
	const delay = 4800 * time.Millisecond
	sent := map[string]time.Time{}
	done := make(chan error, published)
	for i := range published {
		msg := message.NewMessage(fmt.Sprint(i), nil)
		sent[msg.UUID] = time.Now()
		go func() { done <- d.Schedule(queueCtx(q), msg, delay) }()
	}
	seen := map[string]int{}
	var early, late, duplicates, failed int
	var worst time.Duration
	deadline := time.After(delay + 10*time.Second)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
wait:
	for len(seen) < published-failed {
		select {
		case err := <-done:
			if err != nil {
				failed++
				t.Errorf("Schedule: %v", err)
			}
		case <-tick.C:
			fill() // level 4 stays full throughout
		case a := <-arrivals:
			if _, ours := sent[a.msg.UUID]; !ours {
				continue // a filler
			}
			seen[a.msg.UUID]++
			if seen[a.msg.UUID] > 1 {
				duplicates++
			}
			errd := a.at.Sub(sent[a.msg.UUID]) - delay
			worst = max(worst, errd)
			switch {
			case errd < -3*earlyPerLevel:
				early++
			case errd > lateTolerance:
				late++
			}
		case <-deadline:
			break wait
		}
	}
	lost := published - failed - len(seen)
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), published, len(seen), duplicates, lost)
	t.Logf("%s: not scheduled=%d early=%d late=%d worst=%v after the delay (late: more than %v)", t.Name(), failed, early, late, worst.Round(time.Millisecond), lateTolerance)
	if failed > 0 || lost > 0 || early > 0 || late > 0 || duplicates > 0 {
		t.Errorf("not scheduled %d, lost %d, early %d, late %d, duplicates %d; want 0", failed, lost, early, late, duplicates)
	}
}
