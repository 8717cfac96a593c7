package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

// Failures returns how many times the handler fails for uuid before it
// succeeds: 1 or 2 for failPercent% of UUIDs, else 0.
func Failures(uuid string, failPercent int) int {
	h := fnv.New64a()
	_, _ = h.Write([]byte(uuid))
	v := h.Sum64()
	if int(v%100) < failPercent {
		return 1 + int((v/100)%2)
	}
	return 0
}

func run() error {
	var (
		uri          = flag.String("uri", "amqp://guest:guest@127.0.0.1:5672/", "AMQP URI")
		exchange     = flag.String("exchange", "", "business exchange (direct)")
		routingKey   = flag.String("routing-key", "order.created", "binding key of the queue")
		queue        = flag.String("queue", "", "originating queue (subscribe topic)")
		prefix       = flag.String("naming-prefix", "", "prefix of the loopback/wait/poison exchanges")
		queueType    = flag.String("queue-type", amqpretry.QueueTypeClassic, "classic or quorum")
		tiersFlag    = flag.String("tiers", "200ms,400ms", "comma-separated delay tiers")
		maxAttempts  = flag.Int("max-attempts", 5, "MaxAttempts")
		initial      = flag.Duration("initial-backoff", 200*time.Millisecond, "first backoff delay (x2, no jitter)")
		failPercent  = flag.Int("fail-percent", 30, "share of UUIDs failing transiently once or twice")
		work         = flag.Duration("work", time.Millisecond, "simulated work per attempt")
		out          = flag.String("out", "", "file the handled UUIDs are appended to")
		nativeMin    = flag.Duration("native-min", 0, "amqpretry.NativeDelayed mode with this NativeDelayedRetry.Min (0: mode off; RabbitMQ 4.3+ quorum queues)")
		nativeMax    = flag.Duration("native-max", 0, "NativeDelayedRetry.Max (0: Min)")
		cascadePfx   = flag.String("cascade-prefix", "", "retry through the delay cascade with this cascade.Config.Prefix (cascade.Mode; -tiers is then ignored)")
		prefetch     = flag.Int("prefetch", 16, "Qos.PrefetchCount of the subscriber")
		crashOn      = flag.String("crash-payload", "", "the process SIGKILLs itself when it handles a message with this payload (faults.TestCrashLoop)")
		maxRedeliv   = flag.Int("max-redeliveries", 0, "MaxRedeliveries (0: default)")
		noQuarantine = flag.Bool("no-crash-quarantine", false, "amqpretry.Config.DisableCrashQuarantine")
	)
	flag.Parse()
	if *exchange == "" || *queue == "" || *prefix == "" || *out == "" {
		return errors.New("-exchange, -queue, -naming-prefix and -out are required")
	}
	var tiers []time.Duration
	for _, s := range strings.Split(*tiersFlag, ",") {
		d, err := time.ParseDuration(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("-tiers: %w", err)
		}
		tiers = append(tiers, d)
	}
	f, err := os.OpenFile(*out, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	var fmu sync.Mutex
	record := func(uuid string) error {
		fmu.Lock()
		defer fmu.Unlock()
		if _, err := f.WriteString(uuid + "\n"); err != nil { // one write per line
			return err
		}
		return f.Sync()
	}

	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	subCfg := wamqp.NewDurableQueueConfig(*uri)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return *exchange }, Type: "direct", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return *routingKey }}
	subCfg.Consume.Qos.PrefetchCount = *prefetch
	mode := amqpretry.Tiers(tiers...)
	switch {
	case *nativeMin > 0 && *cascadePfx != "":
		return errors.New("-native-min and -cascade-prefix choose two retry modes; choose one")
	case *nativeMin > 0:
		mode = amqpretry.NativeDelayed(amqpretry.NativeDelayedRetry{Min: *nativeMin, Max: *nativeMax, Tiers: tiers})
	case *cascadePfx != "":
		mode = cascade.Mode(cascade.Config{Prefix: *cascadePfx}) // -tiers is ignored
	}
	retry, err := amqpretry.New(amqpretry.Config{
		Mode: mode,
		URI:  *uri, Subscriber: subCfg, QueueType: *queueType, Policy: router.Policy{MaxAttempts: *maxAttempts, Backoff: func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval, b.Multiplier, b.RandomizationFactor, b.MaxElapsedTime = *initial, 2, 0, 0
			return b
		}, MaxRedeliveries: *maxRedeliv},
		DisableCrashQuarantine: *noQuarantine,
		Naming: amqpretry.Naming{
			LoopBackExchange: *prefix + ".loopback", WaitExchange: *prefix + ".wait", PoisonExchange: *prefix + ".poison",
		},
		Logger: logger,
	})
	if err != nil {
		return err
	}
	defer retry.Close()
	sub, err := retry.NewSubscriber(logger, 0) // drains in-flight handlers on shutdown
	if err != nil {
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	r.AddMiddleware(retry.Middleware)
	r.AddConsumerHandler("consumer", *queue, sub, func(msg *message.Message) error {
		if *crashOn != "" && string(msg.Payload) == *crashOn {
			fmt.Fprintln(os.Stderr, "CRASH", msg.UUID)
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL) // a crash: no ack, no nack, no clean close
			select {}
		}
		if *work > 0 {
			time.Sleep(*work)
		}
		if middleware.Attempt(msg) <= Failures(msg.UUID, *failPercent) {
			return errors.New("dependency unavailable")
		}
		return record(msg.UUID)
	})

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-r.Running()
		fmt.Println("READY")
	}()
	go func() {
		<-ctx.Done()
		_ = r.Close() // graceful: waits for handlers in flight
	}()
	return r.Run(context.Background())
}
