package amqpretry

import (
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"
)

func TestNativeDelayedRetryValidate(t *testing.T) {
	// base: the mode's settings n (mutated by nmut) in a quorum Config
	// (mutated by mut).
	type native = NativeDelayedRetry
	base := func(mut func(c *Config), nmut ...func(n *native)) Config {
		n := native{Min: time.Second, Max: 4 * time.Second}
		for _, f := range nmut {
			f(&n)
		}
		c := Config{Subscriber: wamqp.NewDurableQueueConfig("amqp://x/"), QueueType: QueueTypeQuorum, Mode: NativeDelayed(n)}
		mut(&c)
		c.setDefaults()
		return c
	}
	nop := func(*Config) {}
	if err := base(nop).Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	if err := base(nop, func(n *native) { n.Max = 0 }).Validate(); err != nil {
		t.Fatalf("Max 0 (= Min): %v", err)
	}
	// (The old "dead-letter" case, NativeDelayedRetry with
	// DeadLetterFirstRetry, cannot be written any more: one Mode value;
	// TestModesExcludeEachOther asserts the native mode never dead-letters
	// first retries.)
	for name, tc := range map[string]struct {
		mut  func(c *Config)
		nmut func(n *native)
		want string
	}{
		"classic":       {func(c *Config) { c.QueueType = QueueTypeClassic }, nil, "NativeDelayed needs QueueType quorum"},
		"min zero":      {nop, func(n *native) { n.Min = 0 }, "NativeDelayedRetry.Min"},
		"min sub-ms":    {nop, func(n *native) { n.Min = 1500 * time.Microsecond }, "NativeDelayedRetry.Min"},
		"max below min": {nop, func(n *native) { n.Max = 500 * time.Millisecond }, "NativeDelayedRetry.Max"},
		"max sub-ms":    {nop, func(n *native) { n.Max = 2*time.Second + time.Microsecond }, "NativeDelayedRetry.Max"},
		"max too long":  {nop, func(n *native) { n.Max = MaxTTL + time.Millisecond }, "NativeDelayedRetry.Max"},
		"tier sub-ms":   {nop, func(n *native) { n.Tiers = []time.Duration{1500 * time.Microsecond} }, "Tiers[0]"},
		"user args": {func(c *Config) { c.Subscriber.Queue.Arguments = amqp.Table{"x-delayed-retry-min": int64(5)} }, nil,
			"x-delayed-retry-min, which NativeDelayedRetry manages"},
	} {
		t.Run(name, func(t *testing.T) {
			var nmut []func(*native)
			if tc.nmut != nil {
				nmut = append(nmut, tc.nmut)
			}
			err := base(tc.mut, nmut...).Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one containing %q", err, tc.want)
			}
		})
	}
	// Off: a user's own arguments are not touched or refused.
	c := base(func(c *Config) {
		c.Mode = nil
		c.Subscriber.Queue.Arguments = amqp.Table{"x-delayed-retry-min": int64(5)}
	})
	if err := c.Validate(); err != nil {
		t.Errorf("mode off with user args: %v", err)
	}
}

func TestCheckNativeSupport(t *testing.T) {
	for v, ok := range map[string]bool{
		"4.3.6": true, "4.3.0-rc.1": true, "4.4.0": true, "5.0.1": true, "4.3": true,
		"4.2.9": false, "4.0.5": false, "3.10.8": false, "": false, "unknown": false,
	} {
		err := checkNativeSupport(amqp.Table{"version": v})
		if (err == nil) != ok {
			t.Errorf("version %q: err = %v, want ok=%v", v, err, ok)
		}
		if err != nil && (!strings.Contains(err.Error(), "4.3") || !strings.Contains(err.Error(), "DeadLetterFirst")) {
			t.Errorf("version %q: error %q should say why (4.3) and what to use instead", v, err)
		}
	}
}

func TestNativeFitsAndArgs(t *testing.T) {
	n := &NativeDelayedRetry{Min: time.Second, Max: 4 * time.Second}
	for _, tc := range []struct {
		d, floor time.Duration
		want     bool
	}{
		{0, 0, false}, // zero-delay copies (guard, fallback) are always published
		{500 * time.Millisecond, 0, true},
		{4 * time.Second, 0, true},
		{4*time.Second + time.Millisecond, 0, false},
		{2 * time.Second, time.Second, true},
		{2 * time.Second, time.Second + time.Millisecond, false}, // RetryAfter above Min: the broker's hold is not guaranteed
	} {
		if got := n.fits(tc.d, tc.floor); got != tc.want {
			t.Errorf("fits(%v, floor %v) = %v, want %v", tc.d, tc.floor, got, tc.want)
		}
	}
	topo := newTopology(Naming{}, []time.Duration{time.Second}, QueueTypeQuorum, false, nil)
	topo.naming.setDefaults()
	topo.native = n
	args := topo.originArgs("q", nil)
	if args["x-delayed-retry-type"] != "all" || args["x-delayed-retry-min"] != int64(1000) || args["x-delayed-retry-max"] != int64(4000) {
		t.Errorf("originArgs = %v", args)
	}
	topo.native = nil
	if _, ok := topo.originArgs("q", nil)["x-delayed-retry-type"]; ok {
		t.Errorf("mode off: originArgs sets x-delayed-retry-type")
	}
}

func TestMarshalerAcquiredCountIsDeliveryOnly(t *testing.T) {
	m := Marshaler{}
	msg, err := m.Unmarshal(amqp.Delivery{Redelivered: true, Body: []byte("x"), DeliveryTag: 1,
		Headers: amqp.Table{"x-acquired-count": int64(3), "user": int64(7)}})
	if err != nil {
		t.Fatal(err)
	}
	if msg.Metadata.Get("x-acquired-count") != "3" {
		t.Fatalf("x-acquired-count metadata %q, want 3", msg.Metadata.Get("x-acquired-count"))
	}
	p, err := m.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := p.Headers["x-acquired-count"]; ok {
		t.Errorf("copy carries x-acquired-count: %v", p.Headers)
	}
	if p.Headers["user"] != int64(7) {
		t.Errorf("user header lost its type: %#v", p.Headers["user"])
	}
	bad, err := m.Unmarshal(amqp.Delivery{Body: []byte("x"), DeliveryTag: 1, Headers: amqp.Table{"x-acquired-count": int64(-1)}})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := bad.Metadata["x-acquired-count"]; ok || !strings.Contains(bad.Metadata.Get("rabbitretry-header-error"), "x-acquired-count") {
		t.Errorf("negative x-acquired-count: metadata %v", bad.Metadata)
	}
}
