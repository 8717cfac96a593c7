package amqpretry_test

import (
	"fmt"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/router"
)

// The retry mode is one value in Config.Mode, and each mode checks what it
// needs: here native delayed retry (RabbitMQ 4.3+ quorum queues) for retries
// up to 2 s, wait queues of 10 s and 1 min for longer ones.
func ExampleNativeDelayed() {
	uri := "amqp://guest:guest@localhost:5672/"
	cfg := amqpretry.Config{
		URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri), QueueType: amqpretry.QueueTypeQuorum,
		Policy: router.Policy{MaxAttempts: 6},
		Mode: amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{
			Min: time.Second, Max: 2 * time.Second, Tiers: []time.Duration{10 * time.Second, time.Minute},
		}),
	}
	fmt.Println(cfg.Mode, cfg.Validate())

	cfg.QueueType = amqpretry.QueueTypeClassic
	fmt.Println(cfg.Validate())

	cfg.Mode = amqpretry.Tiers(500*time.Millisecond, 1500*time.Microsecond)
	fmt.Println(cfg.Mode, cfg.Validate())
	// Output:
	// native-delayed <nil>
	// amqpretry.Config.Mode NativeDelayed needs QueueType quorum (RabbitMQ's delayed retry is a quorum-queue feature); use Mode Tiers on classic queues
	// tiers amqpretry.Config.Mode (tiers): Tiers[1] = 1.5ms is not a whole number of milliseconds (x-message-ttl is in ms)
}
