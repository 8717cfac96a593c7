package metrics_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/metrics"
)

// TestAuditConsumerCollector: the audit consumer's counters, set-aside
// records and undecodable-delivery loops included, are exported.
func TestAuditConsumerCollector(t *testing.T) {
	st := audit.ConsumerStats{Arrivals: 7, Attempts: 3, WriteFailures: 2, SetAside: 1, Reconnects: 4, Undecodable: 5, Lag: 1500 * time.Millisecond}
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewAuditConsumerCollector("", func() audit.ConsumerStats { return st }))
	want := `
# HELP rabbitretry_audit_set_aside_total Audit records the store rejected for good, set aside with the reason.
# TYPE rabbitretry_audit_set_aside_total counter
rabbitretry_audit_set_aside_total 1
# HELP rabbitretry_audit_undecodable_total Connections the AMQP client closed on an audit delivery it could not decode (a looping message).
# TYPE rabbitretry_audit_undecodable_total counter
rabbitretry_audit_undecodable_total 5
# HELP rabbitretry_audit_records_written_total Audit records written to the store, by kind (arrival, attempt).
# TYPE rabbitretry_audit_records_written_total counter
rabbitretry_audit_records_written_total{kind="arrival"} 7
rabbitretry_audit_records_written_total{kind="attempt"} 3
# HELP rabbitretry_audit_lag_seconds How old the newest attempt record of the last written batch was when it was committed: the audit's lag.
# TYPE rabbitretry_audit_lag_seconds gauge
rabbitretry_audit_lag_seconds 1.5
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"rabbitretry_audit_set_aside_total", "rabbitretry_audit_undecodable_total", "rabbitretry_audit_records_written_total", "rabbitretry_audit_lag_seconds"); err != nil {
		t.Fatal(err)
	}
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 8 {
		t.Fatalf("%d series, %v; want 8", n, err)
	}
}
