package router_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// ExampleChain runs the retry chain in-process on gochannel: a flaky message
// is retried until it succeeds, a permanently bad one goes straight to the
// poison topic.
func ExampleChain() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	// The poison topic must be persistent: a plain GoChannel drops a message
	// published before anything subscribed (router.New refuses one).
	poisonPubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
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

// A GoChannel drops a message published to a topic nobody subscribes to
// yet, so as the poison publisher it would lose poisoned messages: the chain
// refuses one that is not persistent.
func ExampleConfig_Validate() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	delayer, err := middleware.NewMemoryDelayer(pubSub, nil, nil)
	if err != nil {
		panic(err)
	}
	defer delayer.Close()

	_, err = router.New(router.Config{Delayer: delayer, PoisonPublisher: pubSub})
	fmt.Println(err)

	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer poison.Close()
	_, err = router.New(router.Config{Delayer: delayer, PoisonPublisher: poison})
	fmt.Println(err)
	// Output:
	// router.Config.PoisonPublisher is a gochannel.GoChannel without Persistent: it silently drops a poisoned message when nothing subscribes to the poison topic yet; create it with gochannel.Config{Persistent: true}
	// <nil>
}

// With Config.Pause, a handler error that says a dependency is down
// (middleware.DependencyUnavailable) pauses consumption instead of charging
// an attempt: the message is held and run again as a probe until the
// dependency is back, still as attempt 1.
func ExampleConfig_pause() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	poison := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer poison.Close()
	delayer, err := middleware.NewMemoryDelayer(pubSub, nil, nil)
	if err != nil {
		panic(err)
	}
	defer delayer.Close()

	chain, err := router.New(router.Config{
		Delayer: delayer, PoisonPublisher: poison,
		Policy: router.Policy{MaxAttempts: 2,
			Pause: &middleware.PauseConfig{ProbeInterval: 10 * time.Millisecond, MaxProbeInterval: 20 * time.Millisecond}},
	})
	if err != nil {
		panic(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	chain.AddTo(r)
	done := make(chan struct{})
	runs := 0
	r.AddConsumerHandler("billing", "orders", pubSub, func(msg *message.Message) error {
		runs++
		if runs <= 3 {
			fmt.Printf("run %d, attempt %d: database down\n", runs, middleware.Attempt(msg))
			return middleware.DependencyUnavailable(errors.New("connection refused"))
		}
		fmt.Printf("run %d, attempt %d: ok\n", runs, middleware.Attempt(msg))
		close(done)
		return nil
	})
	go func() { _ = r.Run(context.Background()) }()
	defer r.Close()
	<-r.Running()

	_ = pubSub.Publish("orders", message.NewMessage("order-1", []byte("{}")))
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		fmt.Println("timeout")
	}
	// Output:
	// run 1, attempt 1: database down
	// run 2, attempt 1: database down
	// run 3, attempt 1: database down
	// run 4, attempt 1: ok
}
