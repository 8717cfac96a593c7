package admin_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/poison/admin"
)

// An operator looks at a poison queue, replays the messages poisoned by a
// bug that is now fixed back to their original queue, and purges the rest.
// (Runs against the broker at $AMQP_URI, default the local one: it makes
// its own queues and deletes them.)
func Example() {
	uri := exampleURI()
	orders := "example.admin.orders." + strconv.FormatInt(time.Now().UnixNano(), 36)
	poison := orders + ".poison"
	cleanup := seedPoisonQueue(uri, orders, poison)
	defer cleanup()

	a, err := admin.New(admin.Config{URI: uri}) // loop-back exchange "rabbitretry.loopback"
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close()
	ctx := context.Background()

	stats, err := a.Stats(ctx, poison)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("poisoned:", stats.Depth, "by class:", stats.ByClass)

	// Dry run first: what would a replay of the bug's victims send back?
	bug := admin.Filter{ReasonContains: "nil pointer"}
	res, err := a.Replay(ctx, poison, bug, admin.ReplayOptions{DryRun: true})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("dry run: matched", res.Matched, "replayed", res.Replayed)

	res, err = a.Replay(ctx, poison, bug, admin.ReplayOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("replayed", res.Replayed, "left", res.Left)
	back, err := a.Stats(ctx, orders)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("back in the original queue:", back.Depth)

	left, err := a.List(ctx, poison, admin.Filter{})
	if err != nil {
		log.Fatal(err)
	}
	for _, m := range left {
		fmt.Printf("left: %s (%s): %s\n", m.UUID, m.Class, m.Reason)
	}
	purged, err := a.Purge(ctx, poison, admin.Filter{Class: "permanent"}, false)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("purged", purged)
	// Output:
	// poisoned: 3 by class: map[exhausted:2 permanent:1]
	// dry run: matched 2 replayed 2
	// replayed 2 left 0
	// back in the original queue: 2
	// left: order-3 (permanent): invalid address
	// purged 1
}

// exampleURI is $AMQP_URI, or the local broker.
func exampleURI() string {
	if u := os.Getenv("AMQP_URI"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// seedPoisonQueue declares what amqpretry would have (queue orders bound
// to the loop-back exchange with its own name, and its poison queue) and
// puts three poison copies in it, as middleware.PoisonForwarder writes
// them. It returns a func deleting both queues.
func seedPoisonQueue(uri, orders, poison string) func() {
	conn, err := amqp.Dial(uri)
	if err != nil {
		log.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	must := func(err error) {
		if err != nil {
			log.Fatal(err)
		}
	}
	must(ch.ExchangeDeclare("rabbitretry.loopback", "direct", true, false, false, false, nil))
	for _, q := range []string{orders, poison} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		must(err)
	}
	must(ch.QueueBind(orders, orders, "rabbitretry.loopback", false, nil))
	must(ch.Confirm(false))
	for i, c := range []struct{ class, reason string }{
		{"exhausted", "runtime error: nil pointer dereference"},
		{"exhausted", "runtime error: nil pointer dereference"},
		{"permanent", "invalid address"},
	} {
		conf, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", poison, false, false, amqp.Publishing{
			DeliveryMode: amqp.Persistent,
			Body:         []byte(`{"order":` + strconv.Itoa(i+1) + `}`),
			Headers: amqp.Table{
				"_watermill_message_uuid":    "order-" + strconv.Itoa(i+1),
				"reason_poisoned":            c.reason,
				"rabbitretry-error-class":    c.class,
				"rabbitretry-original-queue": orders,
			},
		})
		must(err)
		if !conf.Wait() {
			log.Fatal("seed publish nacked")
		}
	}
	return func() {
		for _, q := range []string{orders, poison} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = conn.Close()
	}
}
