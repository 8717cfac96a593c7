package metrics

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// WaitingCount is one queue's depth at one stage of the retry path.
type WaitingCount struct {
	// Queue is the originating queue the messages will return to ("" for
	// stages shared by every queue, such as the delay cascade's levels).
	Queue string
	// Stage is where they wait: a tier ("1s", "30s"), a cascade level
	// ("level-12"), or "poison" for the poison queue.
	Stage string
	// Messages is the number of messages ready in that queue.
	Messages int
}

// WaitingConfig configures NewWaitingCollector.
type WaitingConfig struct {
	// Namespace prefixes the metric names. Default "rabbitretry".
	Namespace string
	// Sample reads the depths; it is called on every scrape with a context
	// bounded by Timeout. With amqpretry: Retry.Waiting (wait queues and
	// poison queue of the given queues); with the cascade:
	// cascade.Config.Waiting (or Publisher.Waiting). Required.
	Sample func(ctx context.Context) ([]WaitingCount, error)
	// Timeout bounds one Sample call. Default 5 s.
	Timeout time.Duration
}

// Validate reports the first bad field.
func (c WaitingConfig) Validate() error {
	if c.Sample == nil {
		return errors.New("metrics.WaitingConfig.Sample is nil")
	}
	if c.Namespace != "" && !namespaceRE.MatchString(c.Namespace) {
		return fmt.Errorf("metrics.WaitingConfig.Namespace %q is not a valid metric name prefix", c.Namespace)
	}
	if c.Timeout < 0 {
		return fmt.Errorf("metrics.WaitingConfig.Timeout %v is negative", c.Timeout)
	}
	return nil
}

// Names of the waiting collector's metrics, without the namespace.
const (
	nameWaiting      = "waiting_messages"
	nameWaitingError = "waiting_sample_errors_total"
)

// waitingDescriptions returns the metrics of NewWaitingCollector, like
// descriptions.
func waitingDescriptions(namespace string) []description {
	if namespace == "" {
		namespace = defaultNamespace
	}
	return []description{
		{Name: prometheus.BuildFQName(namespace, "", nameWaiting), Type: "gauge", Labels: []string{"queue", "stage"},
			Help: "Messages waiting in the retry path (wait queue tier, cascade level, poison queue), read at scrape time."},
		{Name: prometheus.BuildFQName(namespace, "", nameWaitingError), Type: "counter",
			Help: "Scrapes whose reading of the waiting messages failed."},
	}
}

type waitingCollector struct {
	cfg     WaitingConfig
	waiting *prometheus.Desc
	errors  prometheus.Counter
}

// NewWaitingCollector returns a prometheus.Collector that reads the depth
// of the retry path's queues at each scrape (register it yourself:
// prometheus.MustRegister(c)). A failed reading is counted in
// waiting_sample_errors_total and the depths are left out of that scrape.
// It returns cfg.Validate's error.
func NewWaitingCollector(cfg WaitingConfig) (prometheus.Collector, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Namespace == "" {
		cfg.Namespace = defaultNamespace
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	ds := waitingDescriptions(cfg.Namespace)
	return &waitingCollector{
		cfg:     cfg,
		waiting: prometheus.NewDesc(ds[0].Name, ds[0].Help, ds[0].Labels, nil),
		errors:  prometheus.NewCounter(prometheus.CounterOpts{Name: ds[1].Name, Help: ds[1].Help}),
	}, nil
}

func (c *waitingCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.waiting
	c.errors.Describe(ch)
}

func (c *waitingCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
	defer cancel()
	counts, err := c.cfg.Sample(ctx)
	if err != nil {
		c.errors.Inc()
	} else {
		for _, w := range counts {
			ch <- prometheus.MustNewConstMetric(c.waiting, prometheus.GaugeValue, float64(w.Messages), w.Queue, w.Stage)
		}
	}
	c.errors.Collect(ch)
}
