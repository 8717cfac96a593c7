package faults

import (
	"os"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Retry modes a deploy can switch between on one adopted quorum queue.
var retryModes = map[string]envOption{
	"native": func(_ *env, c *amqpretry.Config) {
		// Every retry of the test (backoff 1 s, 2 s, 4 s) is native: held 1 s.
		c.Mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: time.Second, Max: 4 * time.Second, Tiers: plainTiers})
	},
	"tiers":             func(_ *env, c *amqpretry.Config) { plainMode(c) },
	"dead-letter-first": func(_ *env, c *amqpretry.Config) { c.Mode = amqpretry.DeadLetterFirst(plainTiers...) },
	"cascade": func(e *env, c *amqpretry.Config) {
		c.Mode = cascade.Mode(testCascade(e))
	},
}

// plainTiers are the wait-queue tiers of the modes that have them.
var plainTiers = []time.Duration{time.Second, 4 * time.Second}

func plainMode(c *amqpretry.Config) { c.Mode = amqpretry.Tiers(plainTiers...) }

// testCascade is e's own delay cascade, deleted at the end of the test.
func testCascade(e *env) cascade.Config {
	ccfg := cascade.Config{Prefix: e.prefix + ".cascade"}
	if !slices.Contains(e.extraExchanges, ccfg.Prefix) {
		e.extraExchanges = append(e.extraExchanges, ccfg.Prefix) // marks the cleanup as registered
		e.t.Cleanup(func() {
			ch := e.admin.channel()
			defer ch.Close()
			if err := cascadeCore(ccfg).Delete(ch); err != nil {
				e.t.Errorf("deleting the cascade: %v", err)
			}
		})
	}
	return ccfg
}

// Issue #18 item 5: changing the retry mode between deploys keeps the
// count. An always-failing handler, MaxAttempts 4, on a RabbitMQ 4.3 quorum
// queue adopted by policy (so a deploy can change the mode on the live
// queue): three attempts under the first mode, a deploy with the second,
// then the message must be poisoned after exactly one more run: attempts
// [1 2 3 4], never more than MaxAttempts runs. (Before the fix, native ->
// tiers ran [1 2 3 1 2 3 4]: the publish path did not read x-acquired-count.)
// native -> tiers runs in every go test; the other switches (native ->
// dead-letter-first, tiers -> native, dead-letter-first -> native) with
// RABBITRETRY_FAULTS=1.
func TestAttemptsKeptAcrossModeSwitch(t *testing.T) {
	if !brokerAtLeast43() {
		t.Skip("native delayed retry needs RabbitMQ 4.3+ (RABBITRETRY_BROKER_VERSION)")
	}
	mgmt := testkit.HaveMgmt(t)
	for _, sw := range [][2]string{
		{"native", "tiers"}, {"native", "dead-letter-first"}, {"tiers", "native"}, {"dead-letter-first", "native"},
		{"cascade", "tiers"}, {"cascade", "native"}, {"tiers", "cascade"}, {"native", "cascade"},
	} {
		t.Run(sw[0]+"->"+sw[1], func(t *testing.T) {
			if sw != [2]string{"native", "tiers"} && os.Getenv("RABBITRETRY_FAULTS") != "1" {
				t.Skip("~10 s each: the other switches run with RABBITRETRY_FAULTS=1")
			}
			const n, maxAttempts = 5, 4
			e := newEnv(t, amqpretry.QueueTypeQuorum, func(e *env, c *amqpretry.Config) {
				c.MaxAttempts = maxAttempts
				c.Backoff = exactBackoff(time.Second)
				c.AdoptQueue = &amqpretry.AdoptQueue{ManagementURL: mgmt}
				retryModes[sw[0]](e, c)
			})
			deletePolicyAtCleanup(t, mgmt, e.queue)
			uuids, ps := newMessages(n, nil)
			l := newLedger()
			handler := func(msg *message.Message) error {
				l.attempt(msg.UUID, middleware.Attempt(msg))
				return errTransient
			}
			e.declare()
			e.publish(ps...)
			e.start(handler)
			waitFor(t, 30*time.Second, "three attempts of every message", func() bool {
				for _, u := range uuids {
					if len(l.attemptsOf(u)) < 3 {
						return false
					}
				}
				return true
			})
			e.stop()
			before := e.poisonDepth()
			t.Logf("after the first mode: runs of message 0 %v, poisoned %d", l.attemptsOf(uuids[0]), before)
			if before != 0 {
				t.Fatalf("%d poisoned before the deploy: the switch was not tested", before)
			}
			// Deploy: the same queue, the other mode.
			old := e.retry
			cfg := e.cfg
			retryModes[sw[1]](e, &cfg)
			r, err := amqpretry.New(cfg)
			if err != nil {
				t.Fatalf("deploy %s: New: %v", sw[1], err)
			}
			_ = old.Close()
			e.retry, e.cfg = r, cfg
			e.start(handler)
			waitFor(t, 60*time.Second, "every message poisoned", func() bool { return e.poisonDepth() == n })
			e.stop()
			poisoned, _ := e.poisoned()
			acc := account(t, uuids, l.successes(), poisoned)
			for _, u := range uuids {
				if got := l.attemptsOf(u); !slices.Equal(got, []int{1, 2, 3, 4}) {
					t.Errorf("message %s ran at attempts %v, want [1 2 3 4]", u, got)
				}
			}
			t.Logf("runs of message 0: %v", l.attemptsOf(uuids[0]))
			if acc.Poisoned != n {
				t.Errorf("%d poisoned, want %d", acc.Poisoned, n)
			}
		})
	}
}
