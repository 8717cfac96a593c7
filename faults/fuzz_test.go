package faults

import (
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// FuzzAttemptCounter feeds arbitrary rabbitretry-attempt, x-death (the JSON
// the amqpretry Marshaler writes) and x-delivery-count metadata to the
// public AttemptCounter with all three sources. The count never panics,
// always lies in [1, middleware.MaxAttemptsCap], is deterministic, and a
// valid attempt header alone gives exactly its value (capped).
func FuzzAttemptCounter(f *testing.F) {
	f.Add("3", true, `[{"queue":"q","reason":"rejected","count":2}]`, "q", "")
	f.Add("abc", true, "", "q", "7")
	f.Add("99999999999999999999", true, `[{"queue":"q","reason":"rejected","count":9223372036854775807}]`, "q", "-1")
	f.Add("", false, `[{"queue":"q","reason":"delivery_limit","count":-5}]`, "q", "")
	f.Add("-0", true, `not json`, "", "18446744073709551616")
	counter, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, attempt string, hasAttempt bool, xdeath, queue, deliveryCount string) {
		msg := message.NewMessage("uuid", nil)
		if hasAttempt {
			msg.Metadata.Set(middleware.AttemptKey, attempt)
		}
		if xdeath != "" {
			msg.Metadata.Set(middleware.XDeathKey, xdeath)
		}
		if deliveryCount != "" {
			msg.Metadata.Set(retrymeta.XDeliveryCountKey, deliveryCount)
		}
		c, err := middleware.NewAttemptCounter(middleware.AttemptCounterConfig{Sources: []middleware.AttemptSource{
			middleware.HeaderSource(nil),
			amqpwire.XDeathSource(func(*message.Message) string { return queue }),
			amqpwire.DeliveryCountSource(),
		}})
		if err != nil {
			t.Fatal(err)
		}
		n, bad := c.Count(msg)
		if n < 1 || n > middleware.MaxAttemptsCap {
			t.Fatalf("Count = %d, outside [1, %d]", n, middleware.MaxAttemptsCap)
		}
		if n2, bad2 := c.Count(msg); n2 != n || bad2 != bad {
			t.Fatalf("Count not deterministic: %d %q then %d %q", n, bad, n2, bad2)
		}
		if a := middleware.Attempt(msg); a < 1 || a > middleware.MaxAttemptsCap {
			t.Fatalf("Attempt = %d outside the range", a)
		}
		// The default counter and its middleware agree with Attempt.
		var seen int
		_, _ = counter.Middleware(func(m *message.Message) ([]*message.Message, error) {
			seen = middleware.Attempt(m)
			if m.Metadata.Get(middleware.AttemptKey) != strconv.Itoa(seen) {
				t.Fatalf("metadata %q, context %d", m.Metadata.Get(middleware.AttemptKey), seen)
			}
			return nil, nil
		})(msg)
		if seen < 1 || seen > middleware.MaxAttemptsCap {
			t.Fatalf("middleware attempt %d outside the range", seen)
		}
		// A valid attempt header alone is taken at its value, capped.
		if v, err := strconv.ParseInt(attempt, 10, 64); hasAttempt && err == nil && v >= 1 && xdeath == "" && deliveryCount == "" {
			if want := min(v, middleware.MaxAttemptsCap); int64(n) != want {
				t.Fatalf("attempt header %q alone counted as %d, want %d", attempt, n, want)
			}
		}
	})
}

// FuzzConfigValidate: amqpretry.Config.Validate never panics on fuzzed
// MaxAttempts, tiers and queue type; when it accepts a config, the config is
// within the documented ranges; and DefaultTiers always yields tiers that
// Validate accepts.
func FuzzConfigValidate(f *testing.F) {
	f.Add(5, int64(200), int64(400), uint8(2), "classic", int64(1000), 2.0)
	f.Add(0, int64(0), int64(-1), uint8(1), "quorum", int64(1), 1.0)
	f.Add(-1, int64(math.MaxInt64), int64(4294967295), uint8(2), "stream", int64(300000), 10.0)
	f.Add(1000, int64(4294967296), int64(1), uint8(40), "", int64(86400000), 1.5)
	f.Fuzz(func(t *testing.T, maxAttempts int, tier1, tier2 int64, nTiers uint8, queueType string, initialMs int64, multiplier float64) {
		uri := "amqp://guest:guest@127.0.0.1:5672/"
		tiers := make([]time.Duration, 0, nTiers)
		for i := range int(nTiers) {
			switch i % 3 {
			case 0:
				tiers = append(tiers, time.Duration(tier1)*time.Millisecond) // may overflow: fine
			case 1:
				tiers = append(tiers, time.Duration(tier2)) // raw nanoseconds
			default:
				tiers = append(tiers, time.Duration(tier1+int64(i))*time.Millisecond)
			}
		}
		cfg := amqpretry.Config{URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri), Policy: router.Policy{MaxAttempts: maxAttempts}, Mode: amqpretry.Tiers(tiers...), QueueType: queueType}
		err := cfg.Validate()
		if err == nil {
			if maxAttempts < 1 || maxAttempts > middleware.MaxAttemptsCap {
				t.Fatalf("accepted MaxAttempts %d", maxAttempts)
			}
			if len(tiers) > amqpretry.MaxTiers {
				t.Fatalf("accepted %d tiers", len(tiers))
			}
			for _, d := range tiers {
				if d < time.Millisecond || d > amqpretry.MaxTTL || d%time.Millisecond != 0 {
					t.Fatalf("accepted tier %v", d)
				}
			}
			if queueType != amqpretry.QueueTypeClassic && queueType != amqpretry.QueueTypeQuorum {
				t.Fatalf("accepted queue type %q", queueType)
			}
		} else if !strings.HasPrefix(err.Error(), "amqpretry.Config.") {
			t.Fatalf("error does not name the field: %v", err)
		}

		// Default tiers are valid for any sane policy and attempt count.
		if maxAttempts < 1 || maxAttempts > 200 || math.IsNaN(multiplier) {
			return
		}
		initial := time.Duration(1+abs64(initialMs)%(24*3600*1000)) * time.Millisecond
		mult := 1 + math.Mod(math.Abs(multiplier), 9)
		policy := func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval, b.Multiplier, b.RandomizationFactor = initial, mult, 0.5
			b.MaxInterval, b.MaxElapsedTime = 30*24*time.Hour, 0
			return b
		}
		def := amqpretry.DefaultTiers(policy, maxAttempts)
		cfg.Mode, cfg.QueueType = amqpretry.Tiers(def...), amqpretry.QueueTypeClassic
		if err := cfg.Validate(); err != nil {
			t.Fatalf("DefaultTiers(initial %v, x%v, %d attempts) = %v: %v", initial, mult, maxAttempts, def, err)
		}
		for i := 1; i < len(def); i++ {
			if def[i] <= def[i-1] {
				t.Fatalf("DefaultTiers not strictly ascending: %v", def)
			}
		}
	})
}

func abs64(v int64) int64 {
	if v < 0 {
		if v == math.MinInt64 {
			return math.MaxInt64
		}
		return -v
	}
	return v
}
