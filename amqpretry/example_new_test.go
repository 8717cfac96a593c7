package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// A consumer whose first attempt fails: amqpretry parks the message in a
// wait queue for its tier and the broker brings it back to the queue for
// attempt 2. (Runs against the broker at $AMQP_URI, default the local one:
// it makes its own queues and deletes them.)
func ExampleNew() {
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@127.0.0.1:5672/"
	}
	queue := "example.amqpretry.orders." + strconv.FormatInt(time.Now().UnixNano(), 36)
	logger := watermill.NopLogger{}

	retry, err := amqpretry.New(amqpretry.Config{
		URI:        uri,
		Subscriber: wamqp.NewDurableQueueConfig(uri), // topic = queue name
		Mode:       amqpretry.Tiers(200 * time.Millisecond),
		Policy:     router.Policy{MaxAttempts: 3},
		Logger:     logger,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer retry.Close()
	defer func() { _ = retry.DeleteQueues(queue) }() // the example's own queues
	for _, wq := range retry.Topology().WaitQueues(queue) {
		fmt.Println("wait queue:", strings.TrimPrefix(wq, queue))
	}

	sub, err := retry.NewSubscriber(logger, 0)
	if err != nil {
		log.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan struct{})
	r.AddMiddleware(retry.Middleware)
	r.AddConsumerHandler("orders", queue, sub, func(msg *message.Message) error {
		if middleware.Attempt(msg) == 1 {
			fmt.Println("attempt 1: mail server down")
			return errors.New("mail server down")
		}
		fmt.Println("attempt", middleware.Attempt(msg), "handled", string(msg.Payload))
		close(done)
		return nil
	})
	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()

	pub, err := wamqp.NewPublisher(wamqp.NewDurableQueueConfig(uri), logger)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	if err := pub.Publish(queue, message.NewMessage("order-1", []byte("order 1"))); err != nil {
		log.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		fmt.Println("timed out")
	}
	_ = r.Close()
	// Output:
	// wait queue: .wait.200ms
	// attempt 1: mail server down
	// attempt 2 handled order 1
}
