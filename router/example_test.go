package router_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// ExampleChain runs the retry chain in-process on gochannel: a flaky message
// is retried until it succeeds, a permanently bad one goes straight to the
// poison topic.
func ExampleChain() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	poisonPubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer poisonPubSub.Close()
	poisoned, err := poisonPubSub.Subscribe(context.Background(), "poison")
	if err != nil {
		panic(err)
	}

	// Retry copies wait in memory and come back on the topic they came from.
	delayer, err := middleware.NewMemoryDelayer(pubSub, nil, nil)
	if err != nil {
		panic(err)
	}
	defer delayer.Close()

	chain, err := router.New(router.Config{
		Delayer:         delayer,
		PoisonPublisher: poisonPubSub,
		Policy:          router.Policy{MaxAttempts: 3, Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) }},
	})
	if err != nil {
		panic(err)
	}

	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	// Recoverer goes inside the chain, so a panic is retried like an error.
	chain.AddTo(r, wmw.Recoverer)

	succeeded := make(chan struct{}, 1)
	r.AddConsumerHandler("mailer", "orders", pubSub, func(msg *message.Message) error {
		attempt := middleware.Attempt(msg)
		switch string(msg.Payload) {
		case "flaky":
			if attempt < 3 {
				fmt.Printf("flaky: attempt %d failed\n", attempt)
				return errors.New("smtp timeout")
			}
			fmt.Printf("flaky: attempt %d ok\n", attempt)
			succeeded <- struct{}{}
			return nil
		default:
			fmt.Printf("%s: attempt %d refused\n", msg.Payload, attempt)
			return middleware.Permanent(errors.New("no such customer"))
		}
	})
	go func() { _ = r.Run(context.Background()) }()
	defer r.Close()
	<-r.Running()

	_ = pubSub.Publish("orders", message.NewMessage("order-1", []byte("flaky")))
	select {
	case <-succeeded:
	case <-time.After(5 * time.Second):
		fmt.Println("timeout")
		return
	}

	_ = pubSub.Publish("orders", message.NewMessage("order-2", []byte("bad")))
	select {
	case p := <-poisoned:
		p.Ack()
		fmt.Printf("poisoned %s: class=%s attempts=%s reason=%q\n", p.UUID,
			p.Metadata.Get(middleware.ErrorClassKey), p.Metadata.Get("rabbitretry-attempts"), p.Metadata.Get("reason_poisoned"))
	case <-time.After(5 * time.Second):
		fmt.Println("timeout")
	}

	// Output:
	// flaky: attempt 1 failed
	// flaky: attempt 2 failed
	// flaky: attempt 3 ok
	// bad: attempt 1 refused
	// poisoned order-2: class=permanent attempts=1 reason="no such customer"
}

// ExamplePolicy: one retry policy for a broker-free test chain and for
// amqpretry.New, defined once (router.Config and amqpretry.Config both
// embed router.Policy).
func ExamplePolicy() {
	policy := router.Policy{
		MaxAttempts: 3,
		Backoff:     func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
	}

	// In a test: gochannel and an in-memory Delayer.
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubSub.Close()
	delayer, err := middleware.NewMemoryDelayer(pubSub, nil, nil)
	if err != nil {
		panic(err)
	}
	defer delayer.Close()
	chain, err := router.New(router.Config{Policy: policy, Delayer: delayer, PoisonPublisher: pubSub})
	if err != nil {
		panic(err)
	}

	// In the service: the same value.
	retryCfg := amqpretry.Config{Policy: policy, Subscriber: wamqp.NewDurableQueueConfig("amqp://localhost/")}

	fmt.Println(chain.Republisher.MaxAttempts(), retryCfg.MaxAttempts)
	// Output: 3 3
}
