package cascade_test

import (
	"context"
	"errors"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// Example_retry retries a RabbitMQ consumer's failures through the delay
// cascade: each retry waits exactly its backoff delay (rounded up to
// 100 ms), not the nearest tier, in queues shared by every consumer.
// (Compiled, not run: it needs a broker.)
func Example_retry() {
	uri := "amqp://guest:guest@localhost:5672/"
	logger := watermill.NewStdLogger(false, false)

	// One confirm publisher for retries and poison copies (with
	// amqpretry.New, pass retry.Publisher() instead).
	pub, err := confirm.New(confirm.Config{URI: uri})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	delayer, err := cascade.NewDelayer(cascade.Config{Publisher: pub, Logger: logger})
	if err != nil {
		log.Fatal(err)
	}
	defer delayer.Close()

	// The subscriber reads the library's metadata with amqpretry's
	// Marshaler; with the durable-queue config the subscribe topic is the
	// queue name, which is where the Delayer sends a retry back to.
	subCfg := wamqp.NewDurableQueueConfig(uri)
	subCfg.Marshaler = amqpretry.Marshaler{}
	sub, err := wamqp.NewSubscriber(subCfg, logger)
	if err != nil {
		log.Fatal(err)
	}
	poisonPub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(uri), logger)
	if err != nil {
		log.Fatal(err)
	}

	chain, err := router.New(router.Config{
		Delayer:         delayer, // or middleware.NewRepublisher(middleware.RepublisherConfig{Delayer: delayer})
		PoisonPublisher: poisonPub,
		PoisonTopic:     func(ctx context.Context) string { return message.SubscribeTopicFromCtx(ctx) + ".poison" },
		Policy:          router.Policy{MaxAttempts: 6},
		Logger:          logger,
	})
	if err != nil {
		log.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	chain.AddTo(r)
	r.AddConsumerHandler("mailer", "orders", sub, func(msg *message.Message) error {
		// RetryAfter(37s) now waits 37 s, not the next tier up.
		return middleware.RetryAfter(errors.New("rate limited"), 37*time.Second)
	})
	_ = r.Run(context.Background())
}

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
