package metrics_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/rabbitretry/rabbitretry/metrics"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// Serve the retry metrics on /metrics. A dedicated registry is used here; with
// Config.Registerer left nil the metrics go to prometheus.DefaultRegisterer
// and promhttp.Handler() serves them.
func Example() {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(metrics.Config{Registerer: reg})
	if err != nil {
		log.Fatal(err)
	}

	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	delayer, err := middleware.NewMemoryDelayer(pubSub, nil, logger)
	if err != nil {
		log.Fatal(err)
	}
	// A gochannel poison topic must be persistent (router.Config.Validate).
	poisonPubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger)
	chain, err := router.New(router.Config{
		Delayer:         delayer,
		PoisonPublisher: poisonPubSub,
		Policy:          router.Policy{Observer: m.Observer()}, // retries, poisonings and drops
	})
	if err != nil {
		log.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	// m.Middleware after chain.Middleware: it runs inside the chain and
	// counts every handler attempt with its attempt number.
	r.AddMiddleware(chain.Middleware, m.Middleware)
	done := make(chan struct{})
	r.AddConsumerHandler("orders", "orders", pubSub, func(msg *message.Message) error {
		defer close(done)
		return nil
	})
	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()
	if err := pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("{}"))); err != nil {
		log.Fatal(err)
	}
	<-done
	_ = r.Close() // waits for the handler, and so for its metrics
	_ = delayer.Close()

	// In a service: http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// and http.ListenAndServe(":9090", nil).
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Timeout: 5 * time.Second}))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		log.Fatal(err)
	}
	for line := range strings.Lines(string(body)) {
		if strings.HasPrefix(line, "rabbitretry_attempts_total") {
			fmt.Print(line)
		}
	}
	// Output:
	// rabbitretry_attempts_total{outcome="success",queue="orders"} 1
}
