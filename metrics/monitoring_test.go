package metrics_test

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/metrics"
)

// TestMonitoringNamesExist: every metric the Grafana dashboard and the
// alerting rules in monitoring/ name is one the library registers (metrics.New
// and NewWaitingCollector, histogram series suffixes included), and every
// registered metric appears on the dashboard.
func TestMonitoringNamesExist(t *testing.T) {
	known := map[string]string{}
	for _, d := range append(metrics.Descriptions(""), metrics.WaitingDescriptions("")...) {
		known[d.Name] = d.Type
	}
	// The audit Consumer's collector emits every series at each scrape.
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewAuditConsumerCollector("", func() audit.ConsumerStats { return audit.ConsumerStats{} }))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		known[mf.GetName()] = strings.ToLower(mf.GetType().String())
	}
	name := regexp.MustCompile(`\brabbitretry_[a-z_]+`)
	files, err := filepath.Glob(filepath.Join("..", "monitoring", "*"))
	if err != nil || len(files) < 2 {
		t.Fatalf("monitoring files: %v %v", files, err)
	}
	onDashboard := map[string]bool{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range name.FindAllString(string(b), -1) {
			base := n
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if b, ok := strings.CutSuffix(n, suffix); ok && known[b] == "histogram" {
					base = b
				}
			}
			if _, ok := known[base]; !ok {
				t.Errorf("%s names %s, which the library does not register", filepath.Base(f), n)
			}
			if strings.HasSuffix(f, ".json") {
				onDashboard[base] = true
			}
		}
	}
	for n := range known {
		if !onDashboard[n] && !slices.Contains([]string{"rabbitretry_waiting_sample_errors_total"}, n) {
			t.Errorf("metric %s has no panel on the dashboard", n)
		}
	}
}
