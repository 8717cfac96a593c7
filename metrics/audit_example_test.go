package metrics_test

import (
	"fmt"
	"log"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/metrics"
)

// Export an audit.Consumer's counters. In a service, stats is the
// consumer's Stats method: metrics.NewAuditConsumerCollector("", cons.Stats).
func ExampleNewAuditConsumerCollector() {
	stats := func() audit.ConsumerStats { return audit.ConsumerStats{Arrivals: 3, Attempts: 5, Batches: 2} }
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewAuditConsumerCollector("", stats))

	families, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "rabbitretry_audit_records_written_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			fmt.Println(f.GetName(), m.GetLabel()[0].GetValue(), m.GetCounter().GetValue())
		}
	}
	// Output:
	// rabbitretry_audit_records_written_total arrival 3
	// rabbitretry_audit_records_written_total attempt 5
}
