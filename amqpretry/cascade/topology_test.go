package cascade

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// TestTopologyDeletedWhileWaiting (#18.9c): an operator deletes a piece of
// the cascade while messages wait in a level above it. 10 messages are
// scheduled 4.8 s ahead (bits 5 and 4: 3.2 s in level 5, then 1.6 s in
// level 4); right after their confirms, level 4's queue (case "level
// queue") or the delivery exchange (case "delivery exchange", which takes
// level 0's binding to it and every destination binding with it) is
// deleted. Nobody publishes again. Without a topology check the messages
// leave level 5 at 3.2 s into the gap: RabbitMQ's at-least-once
// dead-letter worker keeps them in level 5's dead-letter buffer and retries
// every 3 minutes, so none arrives in time (and none at all while the gap
// stays). With TopologyCheck (500 ms here) the Delayer redeclares the
// cascade and rebinds its destination before they expire: all arrive, none
// early, none late.
func TestTopologyDeletedWhileWaiting(t *testing.T) {
	for _, tc := range []struct {
		name   string
		delete func(ch *amqp.Channel, cfg Config) error
	}{
		{"level queue", func(ch *amqp.Channel, cfg Config) error {
			_, err := ch.QueueDelete(cfg.LevelName(4), false, false, false)
			return err
		}},
		{"delivery exchange", func(ch *amqp.Channel, cfg Config) error {
			return ch.ExchangeDelete(cfg.DeliveryExchange(), false, false)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Config{Levels: 8, QueueName: queueFromCtx, TopologyCheck: 500 * time.Millisecond})
			q := f.cfg.Prefix + ".dest"
			arrivals := f.queue(q)
			d := f.delayer(q)

			const published = 10
			const delay = 4800 * time.Millisecond
			sent := time.Now()
			for i := range published {
				if err := d.Schedule(queueCtx(q), message.NewMessage(fmt.Sprint(i), nil), delay); err != nil {
					t.Fatal(err)
				}
			}
			if err := tc.delete(f.channel(), f.cfg); err != nil {
				t.Fatalf("deleting the %s: %v", tc.name, err)
			}

			seen := map[string]int{}
			var early, late, duplicates int
			levels := popcount(uint64(delay / d.Config().Grain))
			deadline := time.After(delay + 6*time.Second)
		wait:
			for len(seen) < published {
				select {
				case a := <-arrivals:
					seen[a.msg.UUID]++
					if seen[a.msg.UUID] > 1 {
						duplicates++
					}
					switch errd := a.at.Sub(sent) - delay; {
					case errd < -time.Duration(levels+1)*earlyPerLevel:
						early++
					case errd > lateTolerance:
						late++
					}
				case <-deadline:
					break wait
				}
			}
			lost := published - len(seen)
			t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), published, len(seen), duplicates, lost)
			t.Logf("%s: early=%d late=%d (late: more than %v after the delay; lost: not arrived %v after it)", t.Name(), early, late, lateTolerance, 6*time.Second)
			if lost > 0 || early > 0 || late > 0 || duplicates > 0 {
				t.Errorf("after deleting the %s: lost %d, early %d, late %d, duplicates %d; want 0", tc.name, lost, early, late, duplicates)
			}
		})
	}
}
