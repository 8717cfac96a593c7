package cascade_test

import (
	"context"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
)

// Example_scheduled schedules messages with Watermill's delay component on
// RabbitMQ, without the delayed-message exchange plugin. (Compiled, not
// run: it needs a broker.)
func Example_scheduled() {
	uri := "amqp://guest:guest@localhost:5672/"
	pub, err := cascade.NewPublisher(cascade.Config{URI: uri})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()

	// The topic is the destination queue, which must exist (its
	// subscriber declares it); Bind checks that at startup.
	if err := pub.Bind("reminders"); err != nil {
		log.Fatal(err)
	}

	// Delay metadata set on the message...
	msg := message.NewMessage(watermill.NewUUID(), []byte("renew your subscription"))
	delay.Message(msg, delay.For(90*time.Minute))
	if err := pub.Publish("reminders", msg); err != nil {
		log.Fatal(err)
	}

	// ... or in the context, through Watermill's delay publisher.
	delayed, err := delay.NewPublisher(pub, delay.PublisherConfig{AllowNoDelay: true})
	if err != nil {
		log.Fatal(err)
	}
	msg = message.NewMessage(watermill.NewUUID(), []byte("trial ends tomorrow"))
	msg.SetContext(delay.WithContext(context.Background(), delay.Until(time.Now().Add(24*time.Hour))))
	if err := delayed.Publish("reminders", msg); err != nil {
		log.Fatal(err)
	}

	// Watermill's DelayOnError: a failed message goes back to its queue
	// after a growing delay (the PoisonQueue middleware publishes it
	// through the cascade with the delay DelayOnError set).
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	requeue, err := wmw.PoisonQueue(pub, "reminders")
	if err != nil {
		log.Fatal(err)
	}
	r.AddMiddleware(requeue, (&wmw.DelayOnError{InitialInterval: time.Second, MaxInterval: time.Hour, Multiplier: 2}).Middleware)
}
