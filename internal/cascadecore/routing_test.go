package cascadecore

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
)

// topicMatch is RabbitMQ's topic matching ("Exchanges", topic exchange):
// words split on ".", "*" matches exactly one word, "#" zero or more.
func topicMatch(pattern, key string) bool {
	return matchWords(strings.Split(pattern, "."), strings.Split(key, "."))
}

func matchWords(p, k []string) bool {
	if len(p) == 0 {
		return len(k) == 0
	}
	switch p[0] {
	case "#":
		for i := 0; i <= len(k); i++ {
			if matchWords(p[1:], k[i:]) {
				return true
			}
		}
		return false
	case "*":
		return len(k) > 0 && matchWords(p[1:], k[1:])
	default:
		return len(k) > 0 && k[0] == p[0] && matchWords(p[1:], k[1:])
	}
}

func TestTopicMatch(t *testing.T) {
	for _, c := range []struct {
		p, k string
		want bool
	}{
		{"*.1.#", "0.1.q", true}, {"*.1.#", "1.0.q", false}, {"#.q", "0.1.q", true},
		{"*.*.b", "0.1.a.b", false}, {"*.*.a.b", "0.1.a.b", true}, {"1.#", "1", true},
		{"*.*.b", "0.1.b", true}, {"*", "", true}, {"*.a", "a", false},
	} {
		if got := topicMatch(c.p, c.k); got != c.want {
			t.Errorf("topicMatch(%q, %q) = %v", c.p, c.k, got)
		}
	}
}

// sim is the cascade as the broker routes it, built from the Config's own
// binding keys and queue arguments: exchanges with their bindings, queues
// with their TTL and dead-letter exchange.
type sim struct {
	cfg      Config
	bindings map[string][]simBinding // source exchange -> bindings
	ttl      map[string]time.Duration
	dlx      map[string]string
	isLevelQ map[string]bool
}

type simBinding struct {
	pattern    []string // split on "."
	dest       string
	toExchange bool
}

func newSim(t *testing.T, cfg Config, destinations ...string) *sim {
	t.Helper()
	cfg, err := cfg.resolved()
	if err != nil {
		t.Fatal(err)
	}
	s := &sim{cfg: cfg, bindings: map[string][]simBinding{}, ttl: map[string]time.Duration{}, dlx: map[string]string{}, isLevelQ: map[string]bool{}}
	for n := 0; n < cfg.Levels; n++ {
		name := cfg.LevelName(n)
		args := cfg.levelArgs(n)
		s.ttl[name] = time.Duration(args["x-message-ttl"].(int64)) * time.Millisecond
		s.dlx[name] = args["x-dead-letter-exchange"].(string)
		if _, ok := args["x-dead-letter-routing-key"]; ok {
			t.Fatalf("level %d sets x-dead-letter-routing-key: the message would lose its key", n)
		}
		s.isLevelQ[name] = true
		one, zero := cfg.levelPatterns(n)
		s.bindings[name] = append(s.bindings[name], simBinding{strings.Split(one, "."), name, false}, simBinding{strings.Split(zero, "."), cfg.nextExchange(n), true})
	}
	for _, q := range destinations {
		s.bindings[cfg.DeliveryExchange()] = append(s.bindings[cfg.DeliveryExchange()], simBinding{strings.Split(cfg.destinationPattern(q), "."), q, false})
	}
	return s
}

// route returns the queues a publish to exchange with key reaches,
// following exchange-to-exchange bindings.
func (s *sim) route(exchange string, key []string) []string {
	var qs []string
	for _, b := range s.bindings[exchange] {
		if !matchWords(b.pattern, key) {
			continue
		}
		if b.toExchange {
			qs = append(qs, s.route(b.dest, key)...)
		} else {
			qs = append(qs, b.dest)
		}
	}
	return qs
}

// deliver walks a message published to exchange with key through the
// levels: each level queue holds it its TTL, then dead-letters it with the
// same key to its DLX. It returns the destination queue and the total wait.
func (s *sim) deliver(t *testing.T, exchange, key string) (string, time.Duration, []string) {
	t.Helper()
	var total time.Duration
	var path []string
	words := strings.Split(key, ".")
	for hops := 0; hops <= s.cfg.Levels; hops++ {
		qs := s.route(exchange, words)
		if len(qs) != 1 {
			t.Fatalf("key %q at exchange %q reaches %d queues %v, want exactly 1", key, exchange, len(qs), qs)
		}
		q := qs[0]
		if !s.isLevelQ[q] {
			return q, total, path
		}
		path = append(path, q)
		total += s.ttl[q]
		exchange = s.dlx[q]
	}
	t.Fatalf("key %q loops", key)
	return "", 0, nil
}

func ceilGrains(d, grain time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return (d + grain - 1) / grain * grain
}

func checkDelay(t *testing.T, s *sim, d time.Duration, queue string) {
	t.Helper()
	key, err := s.cfg.RoutingKey(d, queue)
	if err != nil {
		t.Fatalf("RoutingKey(%v): %v", d, err)
	}
	want := ceilGrains(d, s.cfg.Grain)
	exchange := s.cfg.FirstExchange()
	if want == 0 {
		exchange = s.cfg.DeliveryExchange()
	}
	got, total, path := s.deliver(t, exchange, key)
	if got != queue || total != want {
		t.Fatalf("delay %v, key %q: reached %q after %v (via %v), want %q after %v", d, key, got, total, path, queue, want)
	}
	// What the Delayer and Publisher do: enter at the highest set bit's
	// level; the same destination, delay and levels passed.
	entry := s.cfg.EntryExchange(uint64(want / s.cfg.Grain))
	if got, total, epath := s.deliver(t, entry, key); got != queue || total != want || len(epath) != len(path) {
		t.Fatalf("delay %v, key %q entered at %q: reached %q after %v (via %v), want %q after %v", d, key, entry, got, total, epath, queue, want)
	}
	// The all-zero key also goes through every exchange when published to
	// the first one (Schedule publishes it to the delivery exchange).
	if want == 0 {
		if got, total, _ := s.deliver(t, s.cfg.FirstExchange(), key); got != queue || total != 0 {
			t.Fatalf("zero key via the first exchange reached %q after %v", got, total)
		}
	}
	if len(path) != popcount(uint64(want/s.cfg.Grain)) {
		t.Fatalf("delay %v passes %d levels, want one per set bit", d, len(path))
	}
	pd, pq, err := s.cfg.parseRoutingKey(key)
	if err != nil || pd != want || pq != queue {
		t.Fatalf("parseRoutingKey(%q) = %v, %q, %v; want %v, %q", key, pd, pq, err, want, queue)
	}
}

func popcount(x uint64) int {
	n := 0
	for ; x != 0; x &= x - 1 {
		n++
	}
	return n
}

// TestCascadeArithmetic walks every grain count in [0, 2^16) and random
// larger delays (and sub-grain delays) through a simulation of the
// broker's routing built from the Config's own binding keys and TTLs.
func TestCascadeArithmetic(t *testing.T) {
	// Dotted names, a name that is a suffix of another, and one-word names:
	// each message must reach its own queue only.
	queues := []string{"orders", "a.b", "b", "x.a.b", "svc.orders.v2"}
	for _, cfg := range []Config{{}, {Grain: time.Second}, {Grain: time.Millisecond}, {Grain: 50 * time.Millisecond, Levels: 17}} {
		s := newSim(t, cfg, queues...)
		t.Run(s.cfg.Grain.String(), func(t *testing.T) {
			g := s.cfg.Grain
			max := s.cfg.maxDelay()
			if got, err := cfg.MaxDelay(); err != nil || got != max {
				t.Fatalf("MaxDelay = %v, %v", got, err)
			}
			// Every count below 2^16 for the default and the 50 ms test
			// configuration; 2^12 for the others (the race detector
			// makes the walk slow).
			all := 1 << 16
			if g == time.Second || g == time.Millisecond {
				all = 1 << 12
			}
			for n := range all {
				if time.Duration(n)*g > max {
					break
				}
				checkDelay(t, s, time.Duration(n)*g, queues[n%len(queues)])
			}
			r := rand.New(rand.NewPCG(1, 2))
			for i := range 3000 {
				d := time.Duration(r.Int64N(int64(max))) + 1
				if i%2 == 0 {
					d = time.Duration(r.Int64N(int64(64*g))) + 1 // sub-grain remainders
				}
				checkDelay(t, s, d, queues[i%len(queues)])
			}
			checkDelay(t, s, max, "orders")
			checkDelay(t, s, -time.Second, "orders")
			if _, err := cfg.RoutingKey(max+1, "orders"); err == nil {
				t.Fatalf("RoutingKey(max+1) succeeded")
			}
		})
	}
}

func TestDefaults(t *testing.T) {
	for _, c := range []struct {
		grain  time.Duration
		levels int
	}{{100 * time.Millisecond, 26}, {time.Second, 23}, {time.Millisecond, 32}, {2 * time.Millisecond, 31}, {10 * time.Millisecond, 29}} {
		cfg := Config{Grain: c.grain}
		cfg.setDefaults()
		if cfg.Levels != c.levels {
			t.Errorf("grain %v: default Levels %d, want %d", c.grain, cfg.Levels, c.levels)
		}
		if err := cfg.Validate(); err != nil {
			t.Errorf("grain %v: %v", c.grain, err)
		}
		if max := cfg.maxDelay(); max < amqpretry.MaxTTL-c.grain {
			t.Errorf("grain %v: MaxDelay %v below MaxTTL", c.grain, max)
		}
	}
	var cfg Config
	cfg.setDefaults()
	if got := cfg.maxDelay(); got != 6710886300*time.Millisecond {
		t.Errorf("default MaxDelay %v", got)
	}
	if cfg.FirstExchange() != "rabbitretry.delay.level.25" || cfg.DeliveryExchange() != "rabbitretry.delay.delivery" {
		t.Errorf("names %q %q", cfg.FirstExchange(), cfg.DeliveryExchange())
	}
	key, err := Config{}.RoutingKey(1500*time.Millisecond, "orders")
	if want := strings.Repeat("0.", 22) + "1.1.1.1.orders"; err != nil || key != want {
		t.Errorf("RoutingKey(1.5s) = %q, %v; want %q", key, err, want)
	}
	// 1.55 s is 15.5 grains: rounded up to 16.
	key, _ = Config{}.RoutingKey(1550*time.Millisecond, "orders")
	if want := strings.Repeat("0.", 21) + "1.0.0.0.0.orders"; key != want {
		t.Errorf("RoutingKey(1.55s) = %q; want %q", key, want)
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []struct {
		cfg   Config
		field string
	}{
		{Config{Prefix: "amq.delay"}, "Prefix"},
		{Config{Prefix: strings.Repeat("p", 246)}, "Prefix"},
		{Config{Grain: 500 * time.Microsecond}, "Grain"},
		{Config{Grain: 1500 * time.Microsecond}, "Grain"},
		{Config{Grain: -time.Second}, "Grain"},
		{Config{Levels: 33, Grain: time.Millisecond}, "Levels"},
		{Config{Levels: -1}, "Levels"},
		{Config{Levels: 27}, "Levels"}, // 2^26 × 100 ms > MaxTTL
		{Config{QueueType: "stream"}, "QueueType"},
		{Config{URI: "amqp://x", Publisher: &confirm.Publisher{}}, "Publisher"},
		{Config{ManagementURL: "ftp://u:s3cret@h/"}, "ManagementURL"},
	} {
		if strings.Contains(fmt.Sprint(c.cfg.Validate()), "s3cret") {
			t.Errorf("Validate shows the management password: %v", c.cfg.Validate())
		}
		err := c.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), c.field) {
			t.Errorf("%+v: Validate() = %v, want an error naming %s", c.cfg, err, c.field)
		}
		if _, err2 := NewDelayer(c.cfg); err2 == nil {
			t.Errorf("%+v: NewDelayer succeeded", c.cfg)
		}
		if _, _, err2 := c.cfg.parseRoutingKey("0.q"); err2 == nil {
			t.Errorf("%+v: parseRoutingKey succeeded", c.cfg)
		}
	}
	for _, ok := range []Config{{}, {Grain: time.Second, Levels: 1}, {QueueType: amqpretry.QueueTypeClassic}, {Levels: 26}} {
		if err := ok.Validate(); err != nil {
			t.Errorf("%+v: %v", ok, err)
		}
	}
	if _, err := NewDelayer(Config{}); err == nil || !strings.Contains(err.Error(), "URI") {
		t.Errorf("NewDelayer without Publisher or URI: %v", err)
	}
}

func TestQueueNames(t *testing.T) {
	cfg := Config{}
	for _, bad := range []string{"", "a.*.b", "#", "x.#", strings.Repeat("q", 204)} {
		if _, err := cfg.RoutingKey(time.Second, bad); !errors.Is(err, ErrBadQueueName) {
			t.Errorf("RoutingKey(%q): %v, want ErrBadQueueName", bad, err)
		}
	}
	for _, good := range []string{"a*b", "a.b#", strings.Repeat("q", 203), "a..b"} {
		if _, err := cfg.RoutingKey(time.Second, good); err != nil {
			t.Errorf("RoutingKey(%q): %v", good, err)
		}
	}
}

func TestParseRoutingKey(t *testing.T) {
	cfg := Config{Grain: time.Second, Levels: 3}
	for _, bad := range []string{"", "0.1.q", "0.1.2.q", "0.1.1.", "0.1.1", "01.1.q", "a.b.c.q"} {
		if _, _, err := cfg.parseRoutingKey(bad); !errors.Is(err, errBadRoutingKey) {
			t.Errorf("parseRoutingKey(%q): %v, want errBadRoutingKey", bad, err)
		}
	}
	d, q, err := cfg.parseRoutingKey("1.0.1.my.queue")
	if err != nil || d != 5*time.Second || q != "my.queue" {
		t.Errorf("parseRoutingKey = %v %q %v", d, q, err)
	}
	if q, d, ok := cfg.deliveredQueue(cfg.DeliveryExchange(), "1.0.1.my.queue"); !ok || q != "my.queue" || d != 5*time.Second {
		t.Errorf("DeliveredQueue = %q %v %v", q, d, ok)
	}
	if _, _, ok := cfg.deliveredQueue("other", "1.0.1.my.queue"); ok {
		t.Errorf("DeliveredQueue accepted another exchange")
	}
}
