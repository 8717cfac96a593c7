package audit_test

import (
	"context"
	"log"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// Auditing an amqpretry consumer: the Recorder around the retry chain (and
// as its Observer, next to metrics if any), and the Consumer moving
// arrivals and attempt records into PostgreSQL.
func ExampleRecorder() {
	const uri = "amqp://guest:guest@127.0.0.1:5672/"
	ctx := context.Background()

	var retry *amqpretry.Retry
	rec, err := audit.NewRecorder(audit.RecorderConfig{
		URI:     uri,
		TierFor: func(_ string, d time.Duration) time.Duration { return retry.Topology().TierFor(d) },
	})
	if err != nil {
		log.Fatal(err)
	}
	retry, err = amqpretry.New(amqpretry.Config{
		URI:        uri,
		Subscriber: wamqp.NewDurableQueueConfig(uri),
		Policy:     router.Policy{Observer: middleware.Observers(rec.Observer() /* , m.Observer() */)},
	})
	if err != nil {
		log.Fatal(err)
	}
	r, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	r.AddMiddleware(rec.Middleware)        // outside the chain: one record per attempt
	r.AddMiddleware(retry.Middleware)      // the retry chain
	r.AddMiddleware(rec.HandlerMiddleware) // inside: handler duration and error
	// r.AddConsumerHandler(...); go r.Run(ctx)

	store, err := pgstore.New(ctx, pgstore.Config{DSN: "postgres://postgres@127.0.0.1:5432/audit"})
	if err != nil {
		log.Fatal(err)
	}
	cons, err := audit.NewConsumer(audit.ConsumerConfig{
		URI: uri, Store: store,
		Exchanges: []audit.Binding{{Exchange: "orders"}}, // every routing key ("#")
	})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = cons.Run(ctx) }()

	// Shutdown: router first, then the Recorder (flushes what is buffered).
	_ = r.Close()
	_ = rec.Close(ctx)
	_ = retry.Close()
}
