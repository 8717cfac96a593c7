package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Arrival tolerances on the real broker (see TestArrivalTimes):
//   - early: a message may not arrive before its delay, except for the
//     broker's millisecond timestamps: each level truncates the enqueue time
//     to the millisecond, so up to 1 ms per level passed, plus 1 ms for our
//     own clock reads.
//   - late: the publish confirm, each hop (a quorum queue commits every
//     enqueue through Raft with an fsync, and its at-least-once dead-letter
//     worker publishes and waits for the next queue's confirm), and the
//     delivery to our consumer. Measured on this 2-core machine: tens of ms
//     in total per message, 150–300 ms for the worst message of a burst when
//     the machine is loaded. 1.5 s keeps the test meaningful (a level
//     skipped or doubled is at least one grain per bit, and a message stuck
//     behind another one would wait a whole level TTL, seconds) without
//     flaking under a loaded CI runner.
const (
	earlyPerLevel = time.Millisecond
	lateTolerance = 1500 * time.Millisecond
)

type fixture struct {
	t    *testing.T
	uri  string
	cfg  Config
	pub  *confirm.Publisher
	conn *amqp.Connection
}

// newFixture connects a publisher and a consumer connection and names a
// cascade of its own (deleted, with the test's queues, in t.Cleanup).
func newFixture(t *testing.T, cfg Config) *fixture {
	t.Helper()
	uri := testkit.URI(t)
	pub, err := confirm.New(confirm.Config{URI: uri, ConfirmTimeout: 20 * time.Second})
	if err != nil {
		t.Fatalf("publisher: %v", err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	cfg.Prefix = testkit.UniqueName(t, "cascade")
	cfg.Publisher = pub
	f := &fixture{t: t, uri: uri, cfg: cfg, pub: pub, conn: conn}
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("cleanup channel: %v", err)
			return
		}
		defer ch.Close()
		if err := cfg.Delete(ch); err != nil {
			t.Errorf("deleting the cascade: %v", err)
		}
	})
	return f
}

func (f *fixture) channel() *amqp.Channel {
	f.t.Helper()
	ch, err := f.conn.Channel()
	if err != nil {
		f.t.Fatalf("channel: %v", err)
	}
	f.t.Cleanup(func() { _ = ch.Close() })
	return ch
}

type arrival struct {
	msg *message.Message
	at  time.Time
	d   amqp.Delivery
}

// queue declares a classic destination queue named name (deleted in
// t.Cleanup) and consumes it, forwarding each unmarshaled delivery with its
// arrival time.
func (f *fixture) queue(name string) <-chan arrival {
	f.t.Helper()
	ch := f.channel()
	if _, err := ch.QueueDeclare(name, false, false, false, false, nil); err != nil {
		f.t.Fatalf("declaring %s: %v", name, err)
	}
	f.t.Cleanup(func() {
		if ch, err := f.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(name, false, false, false)
			_ = ch.Close()
		}
	})
	ds, err := ch.Consume(name, "", true, false, false, false, nil)
	if err != nil {
		f.t.Fatalf("consuming %s: %v", name, err)
	}
	out := make(chan arrival, 64)
	go func() {
		for d := range ds {
			at := time.Now()
			msg, err := amqpretry.Marshaler{}.Unmarshal(d)
			if err != nil {
				msg = message.NewMessage("unmarshal-error: "+err.Error(), d.Body)
			}
			out <- arrival{msg: msg, at: at, d: d}
		}
	}()
	return out
}

// delayer returns a Delayer with the cascade declared and queues bound, so
// that timings do not include the declarations.
func (f *fixture) delayer(queues ...string) *Delayer {
	f.t.Helper()
	d, err := NewDelayer(f.cfg)
	if err != nil {
		f.t.Fatalf("NewDelayer: %v", err)
	}
	f.t.Cleanup(func() { _ = d.Close() })
	for _, q := range queues {
		if err := d.Bind(q); err != nil {
			f.t.Fatalf("Bind(%q): %v", q, err)
		}
	}
	return d
}

func queueCtx(q string) context.Context { return withQueue(context.Background(), q) }

type queueKey struct{}

func withQueue(ctx context.Context, q string) context.Context {
	return context.WithValue(ctx, queueKey{}, q)
}

func queueFromCtx(ctx context.Context) string { s, _ := ctx.Value(queueKey{}).(string); return s }

// checkArrival returns observed - intended and fails the test outside the
// tolerances.
func (f *fixture) checkArrival(what string, sent, arrived time.Time, want time.Duration) time.Duration {
	f.t.Helper()
	errd := arrived.Sub(sent) - want
	levels := popcount(uint64(want / f.cfg.Grain))
	if errd < -time.Duration(levels+1)*earlyPerLevel || errd > lateTolerance {
		f.t.Errorf("%s: arrived %v after its delay %v (tolerance -%v .. +%v)", what, errd, want, time.Duration(levels+1)*earlyPerLevel, lateTolerance)
	}
	return errd
}

// TestArrivalTimes schedules a burst of delays with different bit patterns
// (0, one low bit, two low bits, two high bits, the top bit, every bit) at
// once and checks each arrives after its delay rounded up to the grain,
// within the tolerances above.
func TestArrivalTimes(t *testing.T) {
	for _, qt := range []string{amqpretry.QueueTypeQuorum, amqpretry.QueueTypeClassic} {
		t.Run(qt, func(t *testing.T) {
			f := newFixture(t, Config{Grain: 50 * time.Millisecond, Levels: 6, QueueType: qt, QueueName: queueFromCtx})
			q := f.cfg.Prefix + ".dest"
			arrivals := f.queue(q)
			d := f.delayer(q)

			delays := []time.Duration{0, 50 * time.Millisecond, 120 * time.Millisecond, time.Second, 1600 * time.Millisecond, 3150 * time.Millisecond}
			sent := make(map[string]time.Time)
			var mu sync.Mutex
			var wg sync.WaitGroup
			for i, dl := range delays {
				wg.Add(1)
				go func() {
					defer wg.Done()
					id := fmt.Sprintf("m%d", i)
					mu.Lock()
					sent[id] = time.Now()
					mu.Unlock()
					if err := d.Schedule(queueCtx(q), message.NewMessage(id, []byte(dl.String())), dl); err != nil {
						t.Errorf("Schedule(%v): %v", dl, err)
					}
				}()
			}
			wg.Wait()
			var report []string
			for range delays {
				a := testkit.Recv(t, arrivals, 10*time.Second)
				var i int
				if _, err := fmt.Sscanf(a.msg.UUID, "m%d", &i); err != nil {
					t.Fatalf("unexpected message %q", a.msg.UUID)
				}
				want := ceilGrains(delays[i], f.cfg.Grain)
				mu.Lock()
				e := f.checkArrival(a.msg.UUID, sent[a.msg.UUID], a.at, want)
				mu.Unlock()
				report = append(report, fmt.Sprintf("%v:%+v", want, e.Round(time.Millisecond)))
				if string(a.msg.Payload) != delays[i].String() {
					t.Errorf("payload %q", a.msg.Payload)
				}
				// The delivery names the exchange its last routing
				// started at: level n-1's for lowest set bit n.
				wantEx := f.cfg.DeliveryExchange()
				if g := uint64(want / f.cfg.Grain); g != 0 {
					if low := bits.TrailingZeros64(g); low > 0 {
						wantEx = f.cfg.LevelName(low - 1)
					}
				}
				if a.d.Exchange != wantEx {
					t.Errorf("%v delivered through %q, want %q", want, a.d.Exchange, wantEx)
				}
				if gotQ, gotD, ok := f.cfg.deliveredQueue(a.d.Exchange, a.d.RoutingKey); !ok || gotQ != q || gotD != want {
					t.Errorf("DeliveredQueue(%q, %q) = %q %v %v", a.d.Exchange, a.d.RoutingKey, gotQ, gotD, ok)
				}
			}
			sort.Strings(report)
			t.Logf("%s: delay:arrival error %s", qt, strings.Join(report, " "))
		})
	}
}

// TestNoHeadOfLineBlocking publishes the longest delay first and a short
// one after it: the short one must not wait for the long one.
func TestNoHeadOfLineBlocking(t *testing.T) {
	f := newFixture(t, Config{Grain: 50 * time.Millisecond, Levels: 7, QueueName: queueFromCtx})
	q := f.cfg.Prefix + ".dest"
	arrivals := f.queue(q)
	d := f.delayer(q)
	long, short := 6350*time.Millisecond, 150*time.Millisecond // every bit; bits 0 and 1
	if err := d.Schedule(queueCtx(q), message.NewMessage("long", nil), long); err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	if err := d.Schedule(queueCtx(q), message.NewMessage("short", nil), short); err != nil {
		t.Fatal(err)
	}
	a := testkit.Recv(t, arrivals, 5*time.Second)
	if a.msg.UUID != "short" {
		t.Fatalf("first arrival %q, want short", a.msg.UUID)
	}
	e := f.checkArrival("short", sent, a.at, short)
	a = testkit.Recv(t, arrivals, 15*time.Second)
	if a.msg.UUID != "long" {
		t.Fatalf("second arrival %q, want long", a.msg.UUID)
	}
	t.Logf("short after long: arrival error %v", e.Round(time.Millisecond))
}

// TestDestinations sends one message to each of two queues whose names
// share a suffix ("<p>.b" and "a.<p>.b"): each must reach its own queue
// and nothing else.
func TestDestinations(t *testing.T) {
	f := newFixture(t, Config{Grain: 50 * time.Millisecond, Levels: 4, QueueName: queueFromCtx})
	q1 := f.cfg.Prefix + ".b"
	q2 := "a." + f.cfg.Prefix + ".b"
	in1, in2 := f.queue(q1), f.queue(q2)
	d := f.delayer()
	if err := d.Schedule(queueCtx(q1), message.NewMessage("for-q1", nil), 150*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := d.Schedule(queueCtx(q2), message.NewMessage("for-q2", nil), 150*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if a := testkit.Recv(t, in1, 5*time.Second); a.msg.UUID != "for-q1" {
		t.Fatalf("q1 got %q", a.msg.UUID)
	}
	if a := testkit.Recv(t, in2, 5*time.Second); a.msg.UUID != "for-q2" {
		t.Fatalf("q2 got %q", a.msg.UUID)
	}
	// A stray copy would have been enqueued together with the right one,
	// i.e. before these markers (delay 0) are published.
	for _, q := range []string{q1, q2} {
		if err := d.Schedule(queueCtx(q), message.NewMessage("marker-"+q, nil), 0); err != nil {
			t.Fatal(err)
		}
	}
	if a := testkit.Recv(t, in1, 5*time.Second); a.msg.UUID != "marker-"+q1 {
		t.Fatalf("q1 got %q, want its marker", a.msg.UUID)
	}
	if a := testkit.Recv(t, in2, 5*time.Second); a.msg.UUID != "marker-"+q2 {
		t.Fatalf("q2 got %q, want its marker", a.msg.UUID)
	}
}

// TestPublisherDelayMetadata publishes with Watermill's delay component:
// metadata set by delay.Message, a context delay through delay.NewPublisher,
// and no delay (delivered at once).
func TestPublisherDelayMetadata(t *testing.T) {
	f := newFixture(t, Config{Grain: 50 * time.Millisecond, Levels: 6})
	q := f.cfg.Prefix + ".scheduled"
	arrivals := f.queue(q)
	p, err := NewPublisher(f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	if err := p.Bind(q); err != nil {
		t.Fatal(err)
	}
	wrapped, err := delay.NewPublisher(p, delay.PublisherConfig{AllowNoDelay: true})
	if err != nil {
		t.Fatal(err)
	}

	want := map[string]time.Duration{"meta": 700 * time.Millisecond, "ctx": 400 * time.Millisecond, "now": 0}
	sent := map[string]time.Time{}

	m := message.NewMessage("meta", []byte("scheduled"))
	m.Metadata.Set("k", "v")
	delay.Message(m, delay.For(want["meta"]))
	sent["meta"] = time.Now()
	if err := wrapped.Publish(q, m); err != nil {
		t.Fatal(err)
	}
	m = message.NewMessage("ctx", nil)
	m.SetContext(delay.WithContext(context.Background(), delay.For(want["ctx"])))
	sent["ctx"] = time.Now()
	if err := wrapped.Publish(q, m); err != nil {
		t.Fatal(err)
	}
	sent["now"] = time.Now()
	if err := p.Publish(q, message.NewMessage("now", nil)); err != nil {
		t.Fatal(err)
	}

	var order []string
	for range want {
		a := testkit.Recv(t, arrivals, 10*time.Second)
		id := a.msg.UUID
		w, ok := want[id]
		if !ok {
			t.Fatalf("unexpected message %q", id)
		}
		e := f.checkArrival(id, sent[id], a.at, w)
		order = append(order, fmt.Sprintf("%s:%+v", id, e.Round(time.Millisecond)))
		if id == "meta" && (a.msg.Metadata.Get("k") != "v" || string(a.msg.Payload) != "scheduled" || a.msg.Metadata.Get(delay.DelayedForKey) != "700ms") {
			t.Errorf("metadata or payload lost: %v %q", a.msg.Metadata, a.msg.Payload)
		}
	}
	if !strings.HasPrefix(order[0], "now:") || !strings.HasPrefix(order[1], "ctx:") {
		t.Errorf("arrival order %v, want now, ctx, meta", order)
	}
	t.Logf("arrival errors %v", order)

	if err := p.Publish(q+".missing", message.NewMessage("x", nil)); err == nil {
		t.Errorf("publishing to a missing queue succeeded")
	}
	long := message.NewMessage("long", nil)
	delay.Message(long, delay.For(time.Hour))
	if err := p.Publish(q, long); !errors.Is(err, ErrDelayTooLong) {
		t.Errorf("an hour on a 3.15 s cascade: %v, want ErrDelayTooLong", err)
	}
}

// TestDelayerFloorClampAndRedeclare: a RetryAfter floor raises the delay,
// a delay above MaxDelay is clamped, and a cascade deleted under the
// Delayer is redeclared.
func TestDelayerFloorClampAndRedeclare(t *testing.T) {
	f := newFixture(t, Config{Grain: 50 * time.Millisecond, Levels: 3, QueueName: queueFromCtx})
	q := f.cfg.Prefix + ".dest"
	arrivals := f.queue(q)
	d := f.delayer(q)

	sent := time.Now()
	ctx := retrymeta.WithMinimumDelay(queueCtx(q), 200*time.Millisecond)
	if err := d.Schedule(ctx, message.NewMessage("floor", nil), 10*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	a := testkit.Recv(t, arrivals, 5*time.Second)
	e1 := f.checkArrival("floor", sent, a.at, 200*time.Millisecond)

	sent = time.Now()
	if err := d.Schedule(queueCtx(q), message.NewMessage("clamped", nil), time.Hour); err != nil {
		t.Fatal(err)
	}
	a = testkit.Recv(t, arrivals, 5*time.Second)
	e2 := f.checkArrival("clamped", sent, a.at, 350*time.Millisecond)
	t.Logf("floor %v, clamped %v", e1.Round(time.Millisecond), e2.Round(time.Millisecond))

	ch := f.channel()
	if err := f.cfg.Delete(ch); err != nil {
		t.Fatal(err)
	}
	for _, dl := range []time.Duration{0, 100 * time.Millisecond} {
		if err := d.Schedule(queueCtx(q), message.NewMessage("after-delete-"+dl.String(), nil), dl); err != nil {
			t.Fatalf("Schedule(%v) after the cascade was deleted: %v", dl, err)
		}
		if a := testkit.Recv(t, arrivals, 5*time.Second); a.msg.UUID != "after-delete-"+dl.String() {
			t.Fatalf("got %q", a.msg.UUID)
		}
		if err := f.cfg.Delete(ch); err != nil {
			t.Fatal(err)
		}
	}

	if err := d.Schedule(queueCtx("a.*.b"), message.NewMessage("bad", nil), time.Second); !errors.Is(err, middleware.ErrCannotDelay) || !errors.Is(err, ErrBadQueueName) {
		t.Errorf("wildcard queue name: %v", err)
	}
}

// TestDeclareAndWaiting declares the full default topology (26 levels),
// twice, checks a conflicting redeclare names the argument, and counts a
// waiting message per level.
func TestDeclareAndWaiting(t *testing.T) {
	f := newFixture(t, Config{QueueName: queueFromCtx})
	ch := f.channel()
	for range 2 {
		if err := f.cfg.Declare(ch); err != nil {
			t.Fatalf("Declare: %v", err)
		}
	}
	q := f.cfg.Prefix + ".dest"
	f.queue(q)
	d := f.delayer()
	// 40 s = 400 grains = 0b110010000: it waits first in level 8 (25.6 s).
	if err := d.Schedule(queueCtx(q), message.NewMessage("waiting", nil), 40*time.Second); err != nil {
		t.Fatal(err)
	}
	var counts []LevelCount
	testkit.WaitFor(t, 10*time.Second, "the message counted in level 8", func() bool {
		var err error
		counts, err = d.Waiting(context.Background())
		if err != nil {
			t.Fatalf("Waiting: %v", err)
		}
		return counts[8].Messages == 1
	})
	if len(counts) != 26 || counts[25].TTL != 3355443200*time.Millisecond || counts[0].TTL != 100*time.Millisecond {
		t.Errorf("counts %+v", counts)
	}
	for _, c := range counts {
		if c.Level != 8 && c.Messages != 0 {
			t.Errorf("level %d has %d messages", c.Level, c.Messages)
		}
	}

	classic := f.cfg
	classic.QueueType = amqpretry.QueueTypeClassic
	ch2 := f.channel()
	// The settings marker refuses it first (settingsExchange), naming
	// both settings.
	if err := classic.Declare(ch2); !errors.Is(err, ErrSettingsMismatch) || !strings.Contains(err.Error(), "levels=26 grain=100ms quorum") ||
		!strings.Contains(err.Error(), "levels=26 grain=100ms classic") {
		t.Errorf("redeclaring as classic: %v, want ErrSettingsMismatch naming both settings", err)
	} else {
		t.Logf("redeclaring as classic: %v", err)
	}
}
