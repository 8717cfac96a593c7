package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// censusPlan is what the census tests schedule: with a 100 ms grain, each
// delay's highest bit is level 4 (1.6 s) or 5 (3.2 s), so every message is
// still in that level when the census runs right after scheduling.
type censusMsg struct {
	dest  string // "A", "B", "C": index into the test's queues
	delay time.Duration
	level int // the level it waits in first
}

func censusPlan() []censusMsg {
	var plan []censusMsg
	add := func(dest string, n int, delay time.Duration, level int) {
		for range n {
			plan = append(plan, censusMsg{dest, delay, level})
		}
	}
	add("A", 3, 1700*time.Millisecond, 4) // 17 grains: levels 4, 0
	add("A", 3, 3300*time.Millisecond, 5) // 33: levels 5, 0
	add("B", 2, 2000*time.Millisecond, 4) // 20: levels 4, 2
	add("B", 2, 5100*time.Millisecond, 5) // 51: levels 5, 4, 1, 0
	add("C", 1, 4000*time.Millisecond, 5) // 40: levels 5, 3
	return plan
}

type censusSetup struct {
	f        *fixture
	d        *Delayer
	queues   map[string]string // "A" -> queue name
	arrivals map[string]<-chan arrival
	sent     map[string]time.Time
	want     map[string]censusMsg
}

// scheduleCensusPlan declares queues A, B, C, schedules censusPlan with
// payload ids and returns when all are confirmed.
func scheduleCensusPlan(t *testing.T) *censusSetup {
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 6, QueueName: queueFromCtx})
	s := &censusSetup{f: f, queues: map[string]string{}, arrivals: map[string]<-chan arrival{},
		sent: map[string]time.Time{}, want: map[string]censusMsg{}}
	for _, k := range []string{"A", "B", "C"} {
		s.queues[k] = f.cfg.Prefix + ".dest" + k
		s.arrivals[k] = f.queue(s.queues[k])
	}
	s.d = f.delayer(s.queues["A"], s.queues["B"], s.queues["C"])
	for i, m := range censusPlan() {
		id := fmt.Sprintf("m%02d-%s-%v", i, m.dest, m.delay)
		s.sent[id] = time.Now()
		s.want[id] = m
		if err := s.d.Schedule(queueCtx(s.queues[m.dest]), message.NewMessage(id, []byte(id)), m.delay); err != nil {
			t.Fatalf("Schedule %s: %v", id, err)
		}
	}
	return s
}

// collect receives len(s.want) messages from the queues in expect (dest
// key -> the queue key it should arrive in), checks each arrives on time
// at that queue, once, and that no queue receives anything else by the
// time the cascade is empty. It returns delivered, duplicates, misrouted.
func (s *censusSetup) collect(t *testing.T, expect func(dest string) string) (delivered, duplicates, misrouted int) {
	t.Helper()
	got := map[string]int{}
	deadline := time.After(20 * time.Second)
	for delivered+duplicates+misrouted < len(s.want) {
		var a arrival
		var at string
		select {
		case a = <-s.arrivals["A"]:
			at = "A"
		case a = <-s.arrivals["B"]:
			at = "B"
		case a = <-s.arrivals["C"]:
			at = "C"
		case <-deadline:
			t.Fatalf("after 20 s: %d delivered, %d duplicates, %d misrouted of %d", delivered, duplicates, misrouted, len(s.want))
		}
		id := string(a.msg.Payload)
		m, ok := s.want[id]
		switch {
		case !ok:
			t.Errorf("unknown message %q at %s", id, at)
			misrouted++
		case at != expect(m.dest):
			t.Errorf("%s (for %s) arrived at %s, want %s", id, m.dest, at, expect(m.dest))
			misrouted++
		case got[id] > 0:
			duplicates++
		default:
			delivered++
			s.f.checkArrival(id, s.sent[id], a.at, m.delay)
		}
		got[id]++
	}
	// Nothing else may come: wait until the level queues are empty, then
	// check that no queue holds anything more.
	testkit.WaitFor(t, 10*time.Second, "the level queues empty", func() bool {
		counts, err := s.d.Waiting(context.Background())
		if err != nil {
			t.Fatalf("Waiting: %v", err)
		}
		for _, c := range counts {
			if c.Messages != 0 {
				return false
			}
		}
		return true
	})
	for k, q := range s.queues { // straight to each queue, not through the delivery exchange's bindings
		if err := s.f.pub.PublishRaw(context.Background(), "", q, amqp.Publishing{Body: []byte("marker-" + k)}); err != nil {
			t.Fatal(err)
		}
	}
	for k := range s.queues {
		for {
			a := testkit.Recv(t, s.arrivals[k], 5*time.Second)
			if string(a.msg.Payload) == "marker-"+k {
				break
			}
			id := string(a.msg.Payload)
			if got[id] > 0 {
				duplicates++
			} else {
				t.Errorf("late extra message %q at %s", id, k)
				misrouted++
			}
			got[id]++
		}
	}
	return delivered, duplicates, misrouted
}

// TestCensusCountsAndPutsBack: the census counts exactly per level and
// destination, with due times within the scheduled ones, and after it
// every message still arrives at its destination on time, exactly once.
func TestCensusCountsAndPutsBack(t *testing.T) {
	t.Parallel()
	s := scheduleCensusPlan(t)
	start := time.Now()
	rep, err := Census(context.Background(), s.f.cfg, CensusOptions{})
	if err != nil {
		t.Fatalf("Census: %v", err)
	}
	took := time.Since(start)
	if took > 1500*time.Millisecond {
		t.Fatalf("census took %v: the level-4 messages may have moved on; counts are not checkable", took)
	}
	want := map[levelQueue]int{}
	for _, m := range censusPlan() {
		want[levelQueue{m.level, s.queues[m.dest]}]++
	}
	got := map[levelQueue]int{}
	for _, e := range rep.Entries {
		got[levelQueue{e.Level, e.Queue}] = e.Messages
		if e.NoDueHeader != 0 || e.EarliestDue.After(e.LatestDue) || e.EarliestDue.Before(start.Add(-10*time.Second)) {
			t.Errorf("entry %+v", e)
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("census per level and destination %v, want %v", got, want)
	}
	if len(rep.Destinations) != 3 || rep.Destinations[0].Messages != 6 || rep.Destinations[1].Messages != 4 || rep.Destinations[2].Messages != 1 {
		t.Errorf("destinations %+v", rep.Destinations)
	}
	n := len(censusPlan())
	if rep.Taken != n || rep.Counted != n || rep.PutBack != n || rep.Foreign != 0 || rep.Moved != 0 {
		t.Errorf("report taken %d counted %d put back %d foreign %d moved %d; want %d, %d, %d, 0, 0",
			rep.Taken, rep.Counted, rep.PutBack, rep.Foreign, rep.Moved, n, n, n)
	}
	// Latest due for B: the 5.1 s ones.
	for _, d := range rep.Destinations {
		if d.Queue == s.queues["B"] {
			if lat := d.LatestDue.Sub(start); lat < 4*time.Second || lat > 5200*time.Millisecond {
				t.Errorf("B's latest due %v after the census started, want about 5.1 s", lat)
			}
		}
	}
	delivered, dup, mis := s.collect(t, func(d string) string { return d })
	t.Logf("census took %v; accounting: scheduled=%d counted=%d delivered=%d duplicates=%d misrouted=%d lost=%d",
		took.Round(time.Millisecond), n, rep.Counted, delivered, dup, mis, n-delivered)
	if delivered != n || dup != 0 || mis != 0 {
		t.Errorf("delivered %d of %d, %d duplicates, %d misrouted", delivered, n, dup, mis)
	}
}

// TestCensusMove: messages for A are put back for B and arrive there on
// time; the others are untouched. A dry run first moves nothing.
func TestCensusMove(t *testing.T) {
	t.Parallel()
	s := scheduleCensusPlan(t)
	a, b := s.queues["A"], s.queues["B"]
	dry, err := Census(context.Background(), s.f.cfg, CensusOptions{Move: map[string]string{a: b}, DryRun: true})
	if err != nil {
		t.Fatalf("dry run: %v", err)
	}
	rep, err := Census(context.Background(), s.f.cfg, CensusOptions{Move: map[string]string{a: b}})
	if err != nil {
		t.Fatalf("Census: %v", err)
	}
	n := len(censusPlan())
	if dry.Moved != 6 || rep.Moved != 6 || rep.Counted != n || rep.PutBack != rep.Taken {
		t.Errorf("dry run moved %d, census moved %d counted %d put back %d of %d taken; want 6, 6, %d", dry.Moved, rep.Moved, rep.Counted, rep.PutBack, rep.Taken, n)
	}
	for _, d := range rep.Destinations {
		if d.Queue == a && d.MovedTo != b {
			t.Errorf("A's entry %+v, want MovedTo B", d)
		}
	}
	delivered, dup, mis := s.collect(t, func(d string) string {
		if d == "A" {
			return "B"
		}
		return d
	})
	t.Logf("accounting: scheduled=%d moved=%d delivered=%d duplicates=%d misrouted=%d lost=%d", n, rep.Moved, delivered, dup, mis, n-delivered)
	if delivered != n || dup != 0 || mis != 0 {
		t.Errorf("delivered %d of %d, %d duplicates, %d misrouted", delivered, n, dup, mis)
	}
}

// TestRedirect: after Redirect(A, B), A's waiting messages arrive at B on
// time, the others are untouched, and nothing arrives at A.
func TestRedirect(t *testing.T) {
	t.Parallel()
	s := scheduleCensusPlan(t)
	ch := s.f.channel()
	if err := s.f.cfg.Redirect(ch, s.queues["A"], s.queues["A"]); !errors.Is(err, errSameQueue) {
		t.Errorf("Redirect to itself: %v, want errSameQueue", err)
	}
	if err := s.f.cfg.Redirect(ch, s.queues["A"], s.queues["B"]); err != nil {
		t.Fatalf("Redirect: %v", err)
	}
	n := len(censusPlan())
	delivered, dup, mis := s.collect(t, func(d string) string {
		if d == "A" {
			return "B"
		}
		return d
	})
	t.Logf("accounting: scheduled=%d delivered=%d duplicates=%d misrouted=%d lost=%d", n, delivered, dup, mis, n-delivered)
	if delivered != n || dup != 0 || mis != 0 {
		t.Errorf("delivered %d of %d, %d duplicates, %d misrouted", delivered, n, dup, mis)
	}
}

// TestCensusWithoutDueHeader: a message published without dueHeader (an
// older publisher) is counted as such and put back with the bound the doc
// promises: never early, at most the level's TTL late. A message with a
// foreign key is put back into its level queue unchanged.
func TestCensusWithoutDueHeader(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 6, QueueName: queueFromCtx})
	q := f.cfg.Prefix + ".dest"
	in := f.queue(q)
	f.delayer(q)
	key, err := f.cfg.RoutingKey(3200*time.Millisecond, q) // level 5 only
	if err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	if err := f.pub.PublishRaw(context.Background(), f.cfg.FirstExchange(), key, amqp.Publishing{Body: []byte("old")}); err != nil {
		t.Fatal(err)
	}
	// A foreign message straight into level 5's queue.
	if err := f.pub.PublishRaw(context.Background(), "", f.cfg.LevelName(5), amqp.Publishing{Body: []byte("foreign")}); err != nil {
		t.Fatal(err)
	}
	rep, err := Census(context.Background(), f.cfg, CensusOptions{Levels: []int{5}})
	censusAt := time.Now()
	if err != nil {
		t.Fatalf("Census: %v", err)
	}
	if len(rep.Entries) != 1 || rep.Entries[0].NoDueHeader != 1 || rep.Entries[0].Level != 5 || rep.Foreign != 1 || rep.Counted != 1 {
		t.Fatalf("report %+v", rep)
	}
	// Both are back in level 5 (the foreign one expires with "old" and is
	// then unroutable: kept by the quorum queue's dead-letter worker until
	// the cascade is deleted).
	testkit.WaitFor(t, 3*time.Second, "both messages back in level 5", func() bool {
		counts, err := f.cfg.Waiting(context.Background(), f.channel())
		return err == nil && counts[5].Messages == 2
	})
	a := testkit.Recv(t, in, 15*time.Second)
	late := a.at.Sub(sent) - 3200*time.Millisecond
	bound := censusAt.Sub(sent) + lateTolerance
	t.Logf("without dueHeader: %v late (census %v after the publish; bound %v)", late.Round(time.Millisecond), censusAt.Sub(sent).Round(time.Millisecond), bound.Round(time.Millisecond))
	if string(a.msg.Payload) != "old" || late < 0 || late > bound {
		t.Errorf("got %q %v late; want \"old\", in [0, %v]", a.msg.Payload, late, bound)
	}
	if v, ok := a.d.Headers[dueHeader].(string); !ok {
		t.Errorf("put-back copy has no dueHeader: %v", a.d.Headers)
	} else if ms, _ := strconv.ParseInt(v, 10, 64); time.UnixMilli(ms).After(a.at.Add(time.Millisecond)) {
		t.Errorf("dueHeader %v after the arrival %v", time.UnixMilli(ms), a.at)
	}
}

// Bad options are refused before anything is taken out.
func TestCensusBadOptions(t *testing.T) {
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 6})
	for _, o := range []CensusOptions{
		{Levels: []int{6}},
		{Move: map[string]string{"a": "a"}},
		{Move: map[string]string{"a": "x.#"}},
	} {
		rep, err := Census(context.Background(), f.cfg, o)
		if err == nil || rep.Taken != 0 {
			t.Errorf("%+v: %v, %d taken; want an error and nothing taken", o, err, rep.Taken)
		} else if !strings.Contains(err.Error(), "CensusOptions") {
			t.Errorf("%+v: %v does not name the option", o, err)
		}
	}
}

// TestCensusInterrupted: a census cancelled mid-level (ctx) puts back what
// it took and leaves the rest: every message is still in the cascade,
// once.
func TestCensusInterrupted(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 12, QueueName: queueFromCtx})
	q := f.cfg.Prefix + ".dest"
	f.queue(q)
	d := f.delayer(q)
	const n = 3000
	errs := make(chan error, 16)
	for w := range 16 {
		go func() {
			var err error
			for i := w; i < n && err == nil; i += 16 {
				// 100..199 s: levels 9 and 10 first; none arrives during the test.
				err = d.Schedule(queueCtx(q), message.NewMessage(fmt.Sprint(i), nil), time.Duration(100+i%100)*time.Second)
			}
			errs <- err
		}()
	}
	for range 16 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	waiting := func() int {
		counts, err := d.Waiting(context.Background())
		if err != nil {
			t.Fatalf("Waiting: %v", err)
		}
		sum := 0
		for _, c := range counts {
			sum += c.Messages
		}
		return sum
	}
	testkit.WaitFor(t, 10*time.Second, "all scheduled messages counted", func() bool { return waiting() == n })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	rep, err := Census(ctx, f.cfg, CensusOptions{})
	t.Logf("interrupted census: %v after %v; taken %d, put back %d, counted %d, returned %d", err, rep.Finished.Sub(rep.Started).Round(time.Millisecond), rep.Taken, rep.PutBack, rep.Counted, rep.Returned)
	testkit.WaitFor(t, 10*time.Second, fmt.Sprintf("%d messages waiting after the interrupted census", n), func() bool {
		return waiting() == n
	})
	// A full census afterwards counts each exactly once.
	rep, err = Census(context.Background(), f.cfg, CensusOptions{})
	if err != nil || rep.Counted != n {
		t.Errorf("census after the interruption: counted %d, %v; want %d", rep.Counted, err, n)
	}
	testkit.WaitFor(t, 10*time.Second, fmt.Sprintf("%d messages waiting after the full census", n), func() bool { return waiting() == n })
	t.Logf("accounting: scheduled=%d counted=%d (in %v, %d deliveries returned at the levels' ends) waiting=%d duplicates=0 lost=0",
		n, rep.Counted, rep.Finished.Sub(rep.Started).Round(time.Millisecond), rep.Returned, waiting())
}
