package metrics

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

// auditConsumerCollector is NewAuditConsumerCollector's collector.
type auditConsumerCollector struct {
	stats                                                                func() audit.ConsumerStats
	written, failures, setAside, malformed, reconnects, undecodable, lag *prometheus.Desc
}

// NewAuditConsumerCollector returns a collector that exports an
// audit.Consumer's counters (audit.ConsumerStats), read from stats (usually
// (*audit.Consumer).Stats) at each scrape, under namespace ("" means
// "rabbitretry"). Register it with prometheus.Registerer.Register:
//
//	reg.MustRegister(metrics.NewAuditConsumerCollector("", consumer.Stats))
//
// Metrics (counters but lag_seconds, names prefixed "<namespace>_audit_"):
//
//	records_written_total{kind="arrival"|"attempt"}  records written to the store (a redelivered record counts again)
//	write_failures_total        failed Store.Write / SetAside calls (each retried, or a rejected batch split)
//	set_aside_total             records the store rejected for good (audit.ErrRecordRejected), set aside with the reason
//	malformed_total             attempt records that could not be decoded (logged and acked)
//	reconnects_total            sessions ended by a lost connection or channel
//	lag_seconds (gauge)         audit.ConsumerStats.Lag: how old the newest attempt record of the last batch was when committed
//	undecodable_total           connections the AMQP client closed on a delivery it could not decode; a growing value is
//	                            a message looping until the queue's delivery limit dead-letters it to the set-aside queue
//
// It panics if namespace does not match [a-zA-Z_][a-zA-Z0-9_]*.
func NewAuditConsumerCollector(namespace string, stats func() audit.ConsumerStats) prometheus.Collector {
	if namespace == "" {
		namespace = defaultNamespace
	}
	if !namespaceRE.MatchString(namespace) {
		panic(fmt.Sprintf("metrics.NewAuditConsumerCollector: namespace %q does not match [a-zA-Z_][a-zA-Z0-9_]*", namespace))
	}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace, "audit", name), help, labels, nil)
	}
	return &auditConsumerCollector{
		stats:       stats,
		written:     d("records_written_total", "Audit records written to the store, by kind (arrival, attempt).", "kind"),
		failures:    d("write_failures_total", "Failed audit store writes (retried, or a rejected batch split)."),
		setAside:    d("set_aside_total", "Audit records the store rejected for good, set aside with the reason."),
		malformed:   d("malformed_total", "Attempt records that could not be decoded (logged and acked)."),
		reconnects:  d("reconnects_total", "Audit consumer sessions ended by a lost connection or channel."),
		undecodable: d("undecodable_total", "Connections the AMQP client closed on an audit delivery it could not decode (a looping message)."),
		lag:         d("lag_seconds", "How old the newest attempt record of the last written batch was when it was committed: the audit's lag."),
	}
}

// Describe implements prometheus.Collector.
func (c *auditConsumerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.written, c.failures, c.setAside, c.malformed, c.reconnects, c.undecodable, c.lag} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *auditConsumerCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	ch <- prometheus.MustNewConstMetric(c.lag, prometheus.GaugeValue, s.Lag.Seconds())
	ch <- prometheus.MustNewConstMetric(c.written, prometheus.CounterValue, float64(s.Arrivals), auditconst.KindArrival)
	ch <- prometheus.MustNewConstMetric(c.written, prometheus.CounterValue, float64(s.Attempts), auditconst.KindAttempt)
	for _, v := range []struct {
		d *prometheus.Desc
		n uint64
	}{{c.failures, s.WriteFailures}, {c.setAside, s.SetAside}, {c.malformed, s.Malformed}, {c.reconnects, s.Reconnects}, {c.undecodable, s.Undecodable}} {
		ch <- prometheus.MustNewConstMetric(v.d, prometheus.CounterValue, float64(v.n))
	}
}
