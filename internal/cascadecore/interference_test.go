package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// logAccount logs the ACCOUNT line of a cascade test (messages published,
// delivered once, duplicates and lost) and the early/late counts.
func logAccount(t *testing.T, published int, got map[string]int, early, late int) {
	t.Helper()
	handled, dup := 0, 0
	for _, k := range got {
		if k > 0 {
			handled++
			dup += k - 1
		}
	}
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), published, handled, dup, published-handled)
	t.Logf("TIMING %s: early=%d late=%d", t.Name(), early, late)
}

// TestInterruptedCensusesNeverEarly is issue #18.9 (a): every interrupted
// census (its connection dropped while it holds prefetched deliveries)
// returns them to the level queue, which on RabbitMQ 4.x counts a delivery
// attempt each ("Quorum Queues", delivery count). With the broker's default
// delivery limit (20 on 4.x) the 21st return dead-lettered them to the next
// level: delivered ~early. 25 interruptions must leave every message in its
// level, and none may reach the destination.
func TestInterruptedCensusesNeverEarly(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 12, QueueName: queueFromCtx})
	q := f.cfg.Prefix + ".dest"
	in := f.queue(q)
	d := f.delayer(q)
	const n = 30
	for i := range n {
		// 300 s: level 11 (204.8 s) first; due long after the test.
		if err := d.Schedule(queueCtx(q), message.NewMessage(fmt.Sprint(i), []byte(fmt.Sprint(i))), 300*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	top := f.cfg.LevelName(11)
rounds:
	for round := range 25 {
		conn, err := amqp.Dial(f.uri)
		if err != nil {
			t.Fatal(err)
		}
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if err := ch.Qos(128, 0, false); err != nil {
			t.Fatal(err)
		}
		ds, err := ch.Consume(top, "", false, false, false, false, nil)
		if err != nil {
			t.Fatalf("round %d: consume: %v", round, err)
		}
		got := 0
		timeout := time.After(5 * time.Second)
		for got < n {
			select {
			case <-ds:
				got++
			case <-timeout:
				t.Errorf("round %d: %d of %d deliveries from %s: the others left it", round, got, n, top)
				_ = conn.Close()
				break rounds
			}
		}
		_ = conn.Close() // the interruption: every held delivery goes back
	}
	waiting := func() []LevelCount {
		counts, err := d.Waiting(context.Background())
		if err != nil {
			t.Fatalf("Waiting: %v", err)
		}
		return counts
	}
	testkit.WaitFor(t, 10*time.Second, "no message held", func() bool {
		sum := 0
		for _, c := range waiting() {
			sum += c.Messages
		}
		return sum+len(in) == n || waiting()[11].Messages == n
	})
	early := n - waiting()[11].Messages
	if k := len(in); k > 0 {
		t.Errorf("%d message(s) delivered after the interruptions, about 5 minutes early", k)
	}
	got := map[string]int{}
	for i := range n - early {
		got[fmt.Sprint(i)] = 1
	}
	logAccount(t, n, got, early, 0)
	if early != 0 {
		t.Errorf("%d message(s) left the top level early", early)
	}
}

// TestDeclareRefusesOtherLevels is issue #18.9 (b): a second Declare of the
// same prefix with other Levels fails with an error naming both settings,
// before it adds any binding (bindings of both would duplicate messages).
func TestDeclareRefusesOtherLevels(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 8})
	if err := f.cfg.Declare(f.channel()); err != nil {
		t.Fatal(err)
	}
	other := f.cfg
	other.Levels = 10
	err := other.Declare(f.channel())
	t.Logf("second declare: %v", err)
	if !errors.Is(err, ErrSettingsMismatch) {
		t.Fatalf("Declare with Levels 10 over Levels 8: %v, want ErrSettingsMismatch", err)
	}
	if !strings.Contains(err.Error(), "levels=8") || !strings.Contains(err.Error(), "levels=10") {
		t.Errorf("error %q does not name both settings", err)
	}
	// Nothing of the second declaration exists: level 8 was not declared.
	ch := f.channel()
	if _, err := ch.QueueDeclarePassive(other.LevelName(8), true, false, false, false, nil); err == nil {
		t.Errorf("level 8 was declared by the refused declaration")
	}
	// The same settings again are fine.
	if err := f.cfg.Declare(f.channel()); err != nil {
		t.Errorf("redeclaring with the same settings: %v", err)
	}
}

// TestCensusClampsDueHeader is issue #18.9 (d): a dueHeader an hour ahead
// (a sender's clock off) must not make a 2 s delay wait an hour: Census
// puts it back with at most what its level and routing key allow.
func TestCensusClampsDueHeader(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 6, QueueName: queueFromCtx})
	q := f.cfg.Prefix + ".dest"
	in := f.queue(q)
	f.delayer(q)
	key, err := f.cfg.RoutingKey(2*time.Second, q) // 20 grains: levels 4, 2
	if err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	future := sent.Add(time.Hour + 2*time.Second)
	p := amqp.Publishing{Body: []byte("skewed"), Headers: amqp.Table{dueHeader: formatDue(future)}}
	if err := f.pub.PublishRaw(context.Background(), f.cfg.EntryExchange(20), key, p); err != nil {
		t.Fatal(err)
	}
	rep, err := Census(context.Background(), f.cfg, CensusOptions{})
	if err != nil {
		t.Fatalf("Census: %v", err)
	}
	t.Logf("census: counted %d, clamped %d, destinations %+v", rep.Counted, rep.Clamped, rep.Destinations)
	got, late := map[string]int{}, 0
	select {
	case a := <-in:
		got[string(a.msg.Payload)]++
		took := a.at.Sub(sent)
		t.Logf("arrived after %v (asked 2 s)", took.Round(time.Millisecond))
		// At most the level-4 TTL and the lower bits (2 s) after the census.
		if took > 2*time.Second+1600*time.Millisecond+lateTolerance {
			late++
			t.Errorf("arrived after %v", took)
		}
	case <-time.After(10 * time.Second):
		late++
		t.Errorf("not delivered within 10 s of a 2 s delay")
	}
	logAccount(t, 1, got, 0, late)
	if rep.Clamped != 1 {
		t.Errorf("report Clamped = %d, want 1", rep.Clamped)
	}
}

// TestUnredirectRoundTrip is issue #19.16: Redirect(A, B) then
// Unredirect(A, B) sends A's messages to A again, on time, and nothing to
// B (the old documented undo unbound B and left A unbound: ~3 min late).
func TestUnredirectRoundTrip(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 6, QueueName: queueFromCtx})
	a, b := f.cfg.Prefix+".A", f.cfg.Prefix+".B"
	inA, inB := f.queue(a), f.queue(b)
	d := f.delayer(a, b)
	ch := f.channel()
	if err := f.cfg.Redirect(ch, a, b); err != nil {
		t.Fatal(err)
	}
	if err := f.cfg.Unredirect(ch, a, b); err != nil {
		t.Fatal(err)
	}
	if err := f.cfg.Unredirect(ch, a, a); !errors.Is(err, errSameQueue) {
		t.Errorf("Unredirect to itself: %v, want errSameQueue", err)
	}
	const n = 10
	sent := map[string]time.Time{}
	for i := range n {
		id := fmt.Sprint(i)
		sent[id] = time.Now()
		if err := d.Schedule(queueCtx(a), message.NewMessage(id, []byte(id)), time.Second); err != nil {
			t.Fatal(err)
		}
	}
	got, late := map[string]int{}, 0
	timeout := time.After(15 * time.Second)
	for len(got) < n {
		select {
		case x := <-inA:
			id := string(x.msg.Payload)
			got[id]++
			if x.at.Sub(sent[id]) > time.Second+lateTolerance {
				late++
			}
		case x := <-inB:
			t.Errorf("%q arrived at B after Unredirect", x.msg.Payload)
		case <-timeout:
			late += n - len(got)
			logAccount(t, n, got, 0, late)
			t.Fatalf("%d of %d arrived at A within 15 s", len(got), n)
		}
	}
	logAccount(t, n, got, 0, late)
	if late != 0 {
		t.Errorf("%d late", late)
	}
}

// TestLegacyLevelQueues: level queues declared by an earlier version
// (without x-delivery-limit) still work: the Delayer declares them as they
// are, and messages arrive.
func TestLegacyLevelQueues(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Config{Grain: 100 * time.Millisecond, Levels: 6, QueueName: queueFromCtx})
	old := f.cfg
	old.legacyLevels = true
	if err := old.Declare(f.channel()); err != nil {
		t.Fatal(err)
	}
	if err := f.cfg.Declare(f.channel()); !legacyLevelQueue(err) {
		t.Fatalf("Declare over legacy level queues: %v, want a refused x-delivery-limit", err)
	}
	q := f.cfg.Prefix + ".dest"
	in := f.queue(q)
	d := f.delayer(q)
	if err := d.Schedule(queueCtx(q), message.NewMessage("1", []byte("1")), 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	a := testkit.Recv(t, in, 10*time.Second)
	logAccount(t, 1, map[string]int{string(a.msg.Payload): 1}, 0, 0)
}
