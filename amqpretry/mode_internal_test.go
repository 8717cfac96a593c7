package amqpretry

import (
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
)

// TestModesExcludeEachOther restores, under Config.Mode, what the
// combination-rule tests guarded before the mode became one value
// (TestConfigRefusesTierModes: the cascade's DelayerFactory refused with
// Tiers, DeadLetterFirstRetry or NativeDelayedRetry; the "dead-letter"
// case of TestNativeDelayedRetryValidate: NativeDelayedRetry refused with
// DeadLetterFirstRetry, "mutually exclusive"): a Config never gets two
// delay mechanisms. Each Mode value configures only its own (a custom
// mode, e.g. the cascade, no wait queue, no first-retry dead-lettering and
// no native delayed retry on Q; the native mode no dead-lettering of first
// retries; DeadLetterFirst no native arguments), as New applies it.
func TestModesExcludeEachOther(t *testing.T) {
	nopFactory := func(DelayerDeps) (CustomDelayer, error) { return CustomDelayer{}, nil }
	for _, tc := range []struct {
		mode                    Mode
		tiers                   []time.Duration
		deadLetterFirst, native bool
	}{
		{Tiers(time.Second), []time.Duration{time.Second}, false, false},
		{DeadLetterFirst(time.Second), []time.Duration{time.Second}, true, false},
		{NativeDelayed(NativeDelayedRetry{Min: time.Second, Tiers: []time.Duration{time.Second}}), []time.Duration{time.Second}, false, true},
		{Custom(nopFactory), nil, false, false},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			c := Config{Subscriber: wamqp.NewDurableQueueConfig("amqp://x/"), QueueType: QueueTypeQuorum, Mode: tc.mode}
			c.setDefaults()
			if err := c.Validate(); err != nil {
				t.Fatalf("valid config: %v", err)
			}
			topo := newTopology(c.Naming, nil, c.QueueType, false, c.Logger) // as New
			c.Mode.configure(&c, topo)
			if len(topo.Tiers()) != len(tc.tiers) || (len(tc.tiers) > 0 && topo.Tiers()[0] != tc.tiers[0]) {
				t.Errorf("wait-queue tiers %v, want %v", topo.Tiers(), tc.tiers)
			}
			if topo.deadLetterFirst != tc.deadLetterFirst || (topo.native != nil) != tc.native {
				t.Errorf("dead-letter first %v, native %v; want %v, %v", topo.deadLetterFirst, topo.native != nil, tc.deadLetterFirst, tc.native)
			}
			args := topo.retryArgs("Q")
			if got, want := args["x-dead-letter-routing-key"], c.Naming.PoisonQueue("Q"); !tc.deadLetterFirst && got != want {
				t.Errorf("Q dead-letters to %v, want its poison queue %q (no first-retry dead-lettering)", got, want)
			}
			if _, ok := args[argDelayedRetryType]; ok != tc.native {
				t.Errorf("Q has %s: %v, want %v", argDelayedRetryType, ok, tc.native)
			}
		})
	}
}

// TestModeValidateNamesField: each Mode value validates its own settings,
// and Config.Validate names the field (Config.Mode, and the mode's setting).
func TestModeValidateNamesField(t *testing.T) {
	for name, tc := range map[string]struct {
		mode      Mode
		queueType string
		want      []string
	}{
		"tiers":                       {Tiers(0), QueueTypeClassic, []string{"amqpretry.Config.Mode", "Tiers[0]"}},
		"dead-letter-first":           {DeadLetterFirst(time.Second, -time.Second), QueueTypeQuorum, []string{"amqpretry.Config.Mode", "Tiers[1]"}},
		"dead-letter-first (classic)": {DeadLetterFirst(), QueueTypeClassic, []string{"amqpretry.Config.Mode", "DeadLetterFirst needs QueueType quorum"}},
		"native-delayed":              {NativeDelayed(NativeDelayedRetry{}), QueueTypeQuorum, []string{"amqpretry.Config.Mode", "NativeDelayedRetry.Min"}},
		"native-delayed (tiers)":      {NativeDelayed(NativeDelayedRetry{Min: time.Second, Tiers: []time.Duration{1500 * time.Microsecond}}), QueueTypeQuorum, []string{"amqpretry.Config.Mode", "Tiers[0]"}},
		"custom":                      {Custom(nil), QueueTypeQuorum, []string{"amqpretry.Config.Mode", "DelayerFactory"}},
	} {
		t.Run(name, func(t *testing.T) {
			c := Config{Subscriber: wamqp.NewDurableQueueConfig("amqp://x/"), QueueType: tc.queueType, Mode: tc.mode}
			c.setDefaults()
			err := c.Validate()
			for _, w := range tc.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("err = %v, want one containing %q", err, w)
				}
			}
		})
	}
}
