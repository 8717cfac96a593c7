// Command schedule shows scheduled messages on RabbitMQ without the
// delayed-message exchange plugin: Watermill's delay component
// (components/delay: delay.Message with delay.For or delay.Until, and
// delay.WithContext through delay.NewPublisher) on top of the delay cascade
// (amqpretry/cascade.Publisher), and Watermill's DelayOnError middleware
// retrying a failing handler through the same cascade.
//
// It schedules four messages: a reminder in 5 minutes and one tomorrow
// (delay.Until) to the queue "<prefix>.reminders", an invoice in 3 days set
// on the message's context to "<prefix>.invoices", and a job to
// "<prefix>.jobs" whose handler fails twice; DelayOnError marks each
// failed attempt with a growing delay (1, then 2 minutes) and the
// PoisonQueue middleware publishes it back to its own queue through the
// cascade. Each message arrives at its queue, and no other, at its due
// time (exact to the cascade's 100 ms grain).
//
//	go run ./examples/schedule                          # real minutes and days
//	go run ./examples/schedule -minute 50ms -day 2s     # the same story in seconds
//
// The cascade (its exchanges and 26 quorum level queues) is declared on
// the first publish and stays: it is shared by every queue of the vhost.
// Messages scheduled days ahead survive broker restarts (quorum level
// queues, at-least-once dead-lettering); see the cascade package doc.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
)

// Config is what the flags set.
type Config struct {
	// URI of the broker. Default $AMQP_URI, else amqp://guest:guest@localhost:5672/.
	URI string
	// Minute and Day are the lengths used for "a minute" and "a day" (1m,
	// 24h; shorter to watch the story in seconds).
	Minute, Day time.Duration
	// Prefix names the queues ("<Prefix>.reminders", ...). Default "schedule".
	Prefix string
	// Cascade configures the delay cascade; the zero value is the default
	// shared cascade ("rabbitretry.delay", 100 ms grain, 26 levels).
	Cascade cascade.Config
	// Out receives the log lines. Default os.Stdout.
	Out io.Writer
}

// Arrival is one message received.
type Arrival struct {
	ID, Queue string
	// Due is when it was scheduled to arrive (the job: its last retry's due time).
	Due, At time.Time
}

// Planned is one message scheduled, and where and when it must arrive.
type Planned struct {
	ID, Queue string
	Due       time.Time
}

// Result is what Run saw.
type Result struct {
	Planned  []Planned
	Arrivals []Arrival
	// JobAttempts is how many times the job's handler ran (2 failures, then success).
	JobAttempts int
}

func main() {
	cfg := Config{}
	flag.StringVar(&cfg.URI, "uri", "", "AMQP URI (default $AMQP_URI, else amqp://guest:guest@localhost:5672/)")
	flag.DurationVar(&cfg.Minute, "minute", time.Minute, "length of a \"minute\" in the story")
	flag.DurationVar(&cfg.Day, "day", 24*time.Hour, "length of a \"day\" in the story")
	flag.StringVar(&cfg.Prefix, "prefix", "schedule", "queue name prefix")
	timeout := flag.Duration("timeout", 0, "give up after this long (default: 3 days + 4 minutes in story time, plus 30s)")
	flag.Parse()
	if *timeout == 0 {
		*timeout = 3*cfg.Day + 4*cfg.Minute + 30*time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if _, err := Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "schedule:", err)
		os.Exit(1)
	}
}

// Run schedules the story's messages and returns once each has arrived
// (or ctx ends, with ctx's error).
func Run(ctx context.Context, cfg Config) (Result, error) {
	if cfg.URI == "" {
		cfg.URI = os.Getenv("AMQP_URI")
	}
	if cfg.URI == "" {
		cfg.URI = "amqp://guest:guest@localhost:5672/"
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "schedule"
	}
	if cfg.Minute <= 0 || cfg.Day <= 0 {
		return Result{}, errors.New("schedule: Minute and Day must be positive")
	}
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	start := time.Now()
	logf := func(format string, args ...any) {
		fmt.Fprintf(cfg.Out, "%8.3fs  "+format+"\n", append([]any{time.Since(start).Seconds()}, args...)...)
	}
	reminders, invoices, jobs := cfg.Prefix+".reminders", cfg.Prefix+".invoices", cfg.Prefix+".jobs"
	logger := watermill.NopLogger{}

	// The subscriber: durable queues named by the topic, with the library's
	// Marshaler (it keeps the typed x-death headers the levels add).
	subCfg := wamqp.NewDurableQueueConfig(cfg.URI)
	subCfg.Marshaler = amqpretry.Marshaler{}
	sub, err := wamqp.NewSubscriber(subCfg, logger)
	if err != nil {
		return Result{}, err
	}
	defer sub.Close()
	for _, q := range []string{reminders, invoices, jobs} {
		if err := sub.SubscribeInitialize(q); err != nil { // declares the queue
			return Result{}, err
		}
	}

	// The cascade publisher: the topic is the destination queue.
	ccfg := cfg.Cascade
	ccfg.URI = cfg.URI
	pub, err := cascade.NewPublisher(ccfg)
	if err != nil {
		return Result{}, err
	}
	defer pub.Close()
	for _, q := range []string{reminders, invoices, jobs} {
		if err := pub.Bind(q); err != nil { // declares the cascade, binds q: fails early if q is missing
			return Result{}, err
		}
	}

	var mu sync.Mutex
	res := Result{}
	due := map[string]time.Time{}
	want := 4
	done := make(chan struct{})
	arrived := func(msg *message.Message, queue string) {
		mu.Lock()
		defer mu.Unlock()
		a := Arrival{ID: msg.UUID, Queue: queue, Due: due[msg.UUID], At: time.Now()}
		res.Arrivals = append(res.Arrivals, a)
		logf("%-10s arrived at %s, %v after its due time", a.ID, queue, a.At.Sub(a.Due).Round(time.Millisecond))
		if len(res.Arrivals) == want {
			close(done)
		}
	}

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return Result{}, err
	}
	router.AddConsumerHandler("reminders", reminders, sub, func(msg *message.Message) error {
		arrived(msg, reminders)
		return nil
	})
	router.AddConsumerHandler("invoices", invoices, sub, func(msg *message.Message) error {
		arrived(msg, invoices)
		return nil
	})
	// The job fails twice. DelayOnError sets the delay metadata of the
	// failed message (1 minute, then 2: InitialInterval, then × Multiplier);
	// PoisonQueue publishes it, through the cascade, back to the job queue
	// itself, and acks the original.
	poison, err := wmw.PoisonQueue(pub, jobs)
	if err != nil {
		return Result{}, err
	}
	delayOnError := &wmw.DelayOnError{InitialInterval: cfg.Minute, MaxInterval: 10 * cfg.Minute, Multiplier: 2}
	jobHandler := router.AddConsumerHandler("jobs", jobs, sub, func(msg *message.Message) error {
		mu.Lock()
		res.JobAttempts++
		attempt := res.JobAttempts
		mu.Unlock()
		if attempt <= 2 {
			d := cfg.Minute << (attempt - 1)
			mu.Lock()
			due[msg.UUID] = time.Now().Add(d)
			mu.Unlock()
			logf("%-10s attempt %d failed; DelayOnError retries it in %v", msg.UUID, attempt, d)
			return fmt.Errorf("job attempt %d: the service it calls is down", attempt)
		}
		arrived(msg, jobs)
		return nil
	})
	jobHandler.AddMiddleware(poison, delayOnError.Middleware)

	go func() { _ = router.Run(ctx) }()
	defer router.Close()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return res, ctx.Err()
	}

	// 1. A reminder in 5 minutes: the delay as metadata (delay.For).
	plan := func(id, queue string, at time.Time) {
		mu.Lock()
		due[id] = at
		res.Planned = append(res.Planned, Planned{ID: id, Queue: queue, Due: at})
		mu.Unlock()
	}
	msg := message.NewMessage("remind-5m", []byte("call back the customer"))
	plan(msg.UUID, reminders, time.Now().Add(5*cfg.Minute)) // (before delay.For reads the clock)
	delay.Message(msg, delay.For(5*cfg.Minute))
	if err := pub.Publish(reminders, msg); err != nil {
		return res, err
	}
	logf("%-10s scheduled for %s in %v (delay.For)", msg.UUID, reminders, 5*cfg.Minute)

	// 2. A reminder tomorrow: a point in time (delay.Until).
	tomorrow := time.Now().Add(cfg.Day)
	msg = message.NewMessage("remind-1d", []byte("renewal is due"))
	delay.Message(msg, delay.Until(tomorrow))
	plan(msg.UUID, reminders, tomorrow)
	if err := pub.Publish(reminders, msg); err != nil {
		return res, err
	}
	logf("%-10s scheduled for %s at %s (delay.Until)", msg.UUID, reminders, tomorrow.UTC().Format(time.RFC3339))

	// 3. An invoice in 3 days: the delay on the context, applied by
	// Watermill's delay publisher (which refuses a message with no delay).
	delayed, err := delay.NewPublisher(pub, delay.PublisherConfig{})
	if err != nil {
		return res, err
	}
	msg = message.NewMessage("invoice-3d", []byte("invoice #42"))
	plan(msg.UUID, invoices, time.Now().Add(3*cfg.Day))
	msg.SetContext(delay.WithContext(context.Background(), delay.For(3*cfg.Day)))
	if err := delayed.Publish(invoices, msg); err != nil {
		return res, err
	}
	logf("%-10s scheduled for %s in %v (delay.WithContext)", msg.UUID, invoices, 3*cfg.Day)

	// 4. A job, now; its retries go through the cascade.
	msg = message.NewMessage("job", []byte("sync account 7"))
	if err := pub.Publish(jobs, msg); err != nil {
		return res, err
	}
	mu.Lock()
	res.Planned = append(res.Planned, Planned{ID: "job", Queue: jobs}) // due: its last retry's
	mu.Unlock()
	logf("%-10s published to %s now", "job", jobs)

	select {
	case <-done:
	case <-ctx.Done():
		return res, fmt.Errorf("waiting for the scheduled messages: %w", ctx.Err())
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range res.Planned {
		if res.Planned[i].ID == "job" {
			res.Planned[i].Due = due["job"]
		}
	}
	sort.Slice(res.Arrivals, func(i, j int) bool { return res.Arrivals[i].At.Before(res.Arrivals[j].At) })
	logf("all %d messages arrived; the job ran %d times", len(res.Arrivals), res.JobAttempts)
	return res, nil
}
