package amqpretry

import (
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

func TestTierFor(t *testing.T) {
	ms := time.Millisecond
	topo := newTopology(Naming{}, []time.Duration{100 * ms, 200 * ms, 400 * ms, 10 * time.Second}, QueueTypeClassic, false, watermill.NopLogger{})
	cases := []struct{ d, want time.Duration }{
		{0, 100 * ms}, {-5 * ms, 100 * ms}, {50 * ms, 100 * ms}, {100 * ms, 100 * ms},
		{141 * ms, 100 * ms}, {142 * ms, 200 * ms}, {200 * ms, 200 * ms}, {282 * ms, 200 * ms}, {283 * ms, 400 * ms},
		{1999 * ms, 400 * ms}, {2100 * ms, 10 * time.Second}, {time.Hour, 10 * time.Second},
	}
	for _, c := range cases {
		if got := topo.TierFor(c.d); got != c.want {
			t.Errorf("TierFor(%v) = %v, want %v", c.d, got, c.want)
		}
	}
}

func TestCheckNames(t *testing.T) {
	n := Naming{}
	n.setDefaults()
	topo := newTopology(n, []time.Duration{time.Second}, QueueTypeClassic, false, watermill.NopLogger{})
	if err := topo.CheckNames(""); err == nil {
		t.Error("empty queue name accepted")
	}
	if err := topo.CheckNames(strings.Repeat("q", 250)); err == nil || !strings.Contains(err.Error(), "255") {
		t.Errorf("queue whose wait queue name exceeds 255 bytes: err = %v", err)
	}
	if err := topo.CheckNames(strings.Repeat("q", 255-len(".quarantine")) /* the longest derived name */); err != nil {
		t.Errorf("name of exactly 255 bytes rejected: %v", err)
	}
	if err := topo.CheckNames("orders.mailer v2"); err != nil {
		t.Errorf("dots and spaces rejected: %v", err)
	}
}

func TestTierAtLeast(t *testing.T) {
	ms := time.Millisecond
	topo := newTopology(Naming{}, []time.Duration{100 * ms, 200 * ms, 400 * ms}, QueueTypeClassic, false, watermill.NopLogger{})
	cases := []struct {
		d, want time.Duration
		ok      bool
	}{{0, 100 * ms, true}, {100 * ms, 100 * ms, true}, {101 * ms, 200 * ms, true}, {399 * ms, 400 * ms, true}, {401 * ms, 400 * ms, false}}
	for _, c := range cases {
		if got, ok := topo.tierAtLeast(c.d); got != c.want || ok != c.ok {
			t.Errorf("TierAtLeast(%v) = %v, %v; want %v, %v", c.d, got, ok, c.want, c.ok)
		}
	}
}
