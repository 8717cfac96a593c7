package cascade_test

import (
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// amqpretry.New with the delay cascade instead of wait-queue tiers: a
// RetryAfter(37s) comes back after 37 s, not after the next tier up.
func ExampleMode() {
	uri := "amqp://guest:guest@localhost:5672/"
	retry, err := amqpretry.New(amqpretry.Config{
		Subscriber: wamqp.NewDurableQueueConfig(uri),
		Mode:       cascade.Mode(cascade.Config{}), // 100 ms grain, quorum level queues
	})
	if err != nil {
		panic(err)
	}
	defer retry.Close()
	sub, err := retry.NewSubscriber(watermill.NopLogger{}, 0)
	if err != nil {
		panic(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	r.AddMiddleware(retry.Middleware)
	r.AddConsumerHandler("mailer", "mailer", sub, func(msg *message.Message) error {
		return middleware.RetryAfter(errors.New("429 Too Many Requests"), 37*time.Second)
	})
	// go r.Run(ctx) ...
}
