// Command quickstart runs the library's main story: orders published to the
// exchange "orders" with routing key "order.created" reach two services with
// their own queues bound with that same key. The mailer's mail server fails
// transiently for some orders a few times, and malformed orders fail
// permanently; billing always succeeds. Retries wait in the broker and come
// back to the mailer only; billing sees each order exactly once.
//
//	go run ./examples/quickstart                     # RabbitMQ at AMQP_URI
//	go run ./examples/quickstart -backend=gochannel  # in-process, no broker
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"sync"
	"syscall"
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

type order struct {
	ID    int    `json:"id"`
	Email string `json:"email"`
}

// story keeps the counts the summary prints.
type story struct {
	start time.Time
	mu    sync.Mutex

	published     map[string]bool
	mailed        map[string]int // successful mails per order UUID
	billed        map[string]int
	attempts      map[string]int
	retried       int
	poisoned      map[string]string // UUID -> reason
	mailerFailing map[string]int    // how many transient failures an order still gets
}

func newStory() *story {
	return &story{start: time.Now(), published: map[string]bool{}, mailed: map[string]int{}, billed: map[string]int{},
		attempts: map[string]int{}, poisoned: map[string]string{}, mailerFailing: map[string]int{}}
}

func (s *story) logf(format string, args ...any) {
	fmt.Printf("%7.3fs  "+format+"\n", append([]any{time.Since(s.start).Seconds()}, args...)...)
}

// errMailServerBusy stands in for an SMTP 421: try again later.
var errMailServerBusy = errors.New("mail server busy (421 try again later)")

func (s *story) mailer(msg *message.Message) error {
	attempt := middleware.Attempt(msg)
	s.mu.Lock()
	s.attempts[msg.UUID]++
	s.mu.Unlock()
	var o order
	if err := json.Unmarshal(msg.Payload, &o); err != nil {
		s.logf("mailer   %s attempt %d: malformed order: %v", short(msg.UUID), attempt, err)
		return fmt.Errorf("decoding order: %w", err) // json errors are permanent by default
	}
	s.mu.Lock()
	fail := s.mailerFailing[msg.UUID] > 0
	if fail {
		s.mailerFailing[msg.UUID]--
	}
	s.mu.Unlock()
	if fail {
		s.logf("mailer   order %-3d attempt %d: %v", o.ID, attempt, errMailServerBusy)
		return errMailServerBusy
	}
	s.mu.Lock()
	s.mailed[msg.UUID]++
	s.mu.Unlock()
	s.logf("mailer   order %-3d attempt %d: mail sent to %s", o.ID, attempt, o.Email)
	return nil
}

func (s *story) billing(msg *message.Message) error {
	s.mu.Lock()
	s.billed[msg.UUID]++
	s.mu.Unlock()
	return nil
}

func short(uuid string) string {
	if len(uuid) > 8 {
		return uuid[:8]
	}
	return uuid
}

// makeOrders returns n orders: every 7th is malformed, every 3rd fails
// transiently 1-2 times at the mail server.
func (s *story) makeOrders(n int) []*message.Message {
	msgs := make([]*message.Message, 0, n)
	for i := 1; i <= n; i++ {
		payload, _ := json.Marshal(order{ID: i, Email: fmt.Sprintf("customer%d@example.com", i)})
		if i%7 == 0 {
			payload = []byte(fmt.Sprintf(`{"id": %d, "email": `, i)) // truncated JSON
		}
		m := message.NewMessage(watermill.NewUUID(), payload)
		s.published[m.UUID] = true
		if i%3 == 0 && i%7 != 0 {
			s.mailerFailing[m.UUID] = 1 + i%2
		}
		msgs = append(msgs, m)
	}
	return msgs
}

// done reports whether every order is accounted for: mailed or poisoned,
// and billed.
func (s *story) done() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range s.published {
		_, poisoned := s.poisoned[id]
		if (s.mailed[id] == 0 && !poisoned) || s.billed[id] == 0 {
			return false
		}
	}
	return true
}

func (s *story) summary() (ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var processed, lost, billedOnce, dupMail int
	for id := range s.published {
		_, p := s.poisoned[id]
		switch {
		case s.mailed[id] > 0:
			processed++
		case !p:
			lost++
		}
		if s.mailed[id] > 1 {
			dupMail++
		}
		if s.billed[id] == 1 {
			billedOnce++
		}
	}
	fmt.Println()
	fmt.Println("== summary")
	fmt.Printf("orders published:         %d\n", len(s.published))
	fmt.Printf("mailer processed:         %d\n", processed)
	fmt.Printf("mailer retries scheduled: %d\n", s.retried)
	fmt.Printf("mailer poisoned:          %d\n", len(s.poisoned))
	reasons := make([]string, 0, len(s.poisoned))
	for id, r := range s.poisoned {
		reasons = append(reasons, fmt.Sprintf("  %s: %s", short(id), r))
	}
	sort.Strings(reasons)
	for _, r := range reasons {
		fmt.Println(r)
	}
	fmt.Printf("billing saw each order exactly once: %v (%d of %d)\n", billedOnce == len(s.published), billedOnce, len(s.published))
	fmt.Printf("duplicate mails: %d\n", dupMail)
	fmt.Printf("lost: %d\n", lost)
	return lost == 0 && billedOnce == len(s.published) && processed+len(s.poisoned) == len(s.published)
}

// observer counts retries and poisonings as the chain reports them.
type observer struct {
	middleware.NopObserver
	s *story
}

func (o observer) RetryScheduled(msg *message.Message, attempt int, delay, took time.Duration) {
	o.s.mu.Lock()
	o.s.retried++
	o.s.mu.Unlock()
	o.s.logf("mailer   %s attempt %d failed -> retry in %v (scheduled and confirmed in %v)", short(msg.UUID), attempt, delay.Round(time.Millisecond), took.Round(time.Microsecond))
}

func (o observer) Poisoned(msg *message.Message, attempt int, class string) {
	o.s.mu.Lock()
	o.s.poisoned[msg.UUID] = fmt.Sprintf("%s after %d attempt(s)", class, attempt)
	o.s.mu.Unlock()
	o.s.logf("mailer   %s poisoned after attempt %d (%s)", short(msg.UUID), attempt, class)
}

func main() {
	backend := flag.String("backend", "amqp", "amqp (RabbitMQ at AMQP_URI) or gochannel (in-process)")
	n := flag.Int("orders", 21, "number of orders to publish")
	timeout := flag.Duration("timeout", 60*time.Second, "give up waiting after this long")
	flag.Parse()

	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = "amqp://guest:guest@localhost:5672/"
	}
	s := newStory()
	var err error
	switch *backend {
	case "amqp":
		err = runAMQP(s, uri, *n, *timeout)
	case "gochannel":
		err = runGoChannel(s, *n, *timeout)
	default:
		err = fmt.Errorf("unknown -backend %q (amqp or gochannel)", *backend)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	if !s.summary() {
		fmt.Fprintln(os.Stderr, "quickstart: the accounting does not add up")
		os.Exit(1)
	}
}

// retryPolicy is the one retry policy both backends run with (the broker's
// amqpretry.New and the in-process router.New): defined once.
func retryPolicy(s *story) router.Policy {
	return router.Policy{MaxAttempts: 4, Backoff: backoffPolicy, Observer: observer{s: s}}
}

// backoffPolicy: 200 ms, 400 ms, 800 ms with ±20% jitter: short enough for a demo.
func backoffPolicy() backoff.BackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 200 * time.Millisecond
	b.RandomizationFactor = 0.2
	b.Multiplier = 2
	b.MaxElapsedTime = 0
	return b
}

func runAMQP(s *story, uri string, n int, timeout time.Duration) error {
	logger := watermill.NopLogger{}
	// The subscriber config: topic "mailer" or "billing" -> queue of that name,
	// bound to the topic exchange "orders" with routing key "order.created".
	subCfg := wamqp.NewDurableQueueConfig(uri)
	subCfg.Exchange = wamqp.ExchangeConfig{
		GenerateName: func(string) string { return "orders" }, Type: "topic", Durable: true,
	}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "order.created" }}
	subCfg.Consume.Qos.PrefetchCount = 16

	retry, err := amqpretry.New(amqpretry.Config{
		URI: uri, Subscriber: subCfg, Policy: retryPolicy(s),
		Logger: logger,
	})
	if err != nil {
		return fmt.Errorf("%w (start RabbitMQ with `make broker`, or use -backend=gochannel)", err)
	}
	defer retry.Close()
	for _, q := range []string{"mailer", "billing"} {
		if err := retry.DeleteQueues(q); err != nil { // each run starts from zero
			return err
		}
	}
	fmt.Printf("retry tiers: %v (wait queues mailer.wait.<tier>), poison queue %s\n",
		retry.Topology().Tiers(), retry.Topology().Naming().PoisonQueue("mailer"))

	sub, err := retry.NewSubscriber(logger, 0) // drains in-flight handlers on shutdown
	if err != nil {
		return err
	}
	defer sub.Close() // already closed once Run has stopped; returns the drain's result
	pubCfg := wamqp.NewDurableQueueConfig(uri)
	pubCfg.Exchange = subCfg.Exchange
	pubCfg.Publish.GenerateRoutingKey = func(string) string { return "order.created" }
	pub, err := wamqp.NewPublisher(pubCfg, logger)
	if err != nil {
		return err
	}
	defer pub.Close()

	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	r.AddMiddleware(retry.Middleware, wmw.Recoverer)
	r.AddConsumerHandler("mailer", "mailer", sub, s.mailer)
	r.AddConsumerHandler("billing", "billing", sub, s.billing)
	return runStory(s, r, n, timeout, func(msgs []*message.Message) error { return pub.Publish("orders", msgs...) })
}

func runGoChannel(s *story, n int, timeout time.Duration) error {
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 256}, logger)
	defer ps.Close()
	delayer, err := middleware.NewMemoryDelayer(ps, nil, logger)
	if err != nil {
		return err
	}
	defer delayer.Close()
	// The poison topic is persistent: a plain GoChannel would drop poisoned
	// messages nobody subscribed to yet (router.New refuses one).
	poisonPS := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	defer poisonPS.Close()
	chain, err := router.New(router.Config{
		Delayer: delayer, PoisonPublisher: poisonPS, PoisonTopic: func(context.Context) string { return "mailer.poison" },
		Policy: retryPolicy(s), Logger: logger,
	})
	if err != nil {
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	chain.AddTo(r, wmw.Recoverer)
	// gochannel has no exchanges: the producer fans out to one topic per service.
	r.AddConsumerHandler("mailer", "orders.mailer", ps, s.mailer)
	r.AddConsumerHandler("billing", "orders.billing", ps, s.billing)
	return runStory(s, r, n, timeout, func(msgs []*message.Message) error {
		for _, m := range msgs {
			if err := ps.Publish("orders.mailer", m.Copy()); err != nil {
				return err
			}
			if err := ps.Publish("orders.billing", m.Copy()); err != nil {
				return err
			}
		}
		return nil
	})
}

func runStory(s *story, r *message.Router, n int, timeout time.Duration, publish func([]*message.Message) error) error {
	// Watermill's usual stop: cancel Run's context (here on Ctrl-C or
	// SIGTERM, or below once every order is accounted for). Run returns once
	// the handlers in flight have finished (their messages acked, retried or
	// poisoned): at once when idle. The draining subscriber then closes.
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-errc:
		return err
	}
	msgs := s.makeOrders(n)
	s.logf("publishing %d orders (every 7th malformed, every 3rd meets a busy mail server)", len(msgs))
	if err := publish(msgs); err != nil {
		cancel()
		return errors.Join(err, <-errc)
	}
	deadline := time.After(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !s.done() {
		select {
		case <-deadline:
			cancel()
			return errors.Join(fmt.Errorf("not every order was accounted for within %v", timeout), <-errc)
		case <-ctx.Done():
			return errors.Join(errors.New("interrupted"), <-errc)
		case <-tick.C:
		}
	}
	stopping := time.Now()
	cancel()
	if err := <-errc; err != nil {
		return err
	}
	s.logf("router stopped in %v", time.Since(stopping).Round(time.Millisecond))
	return nil
}
