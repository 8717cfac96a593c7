package amqpretry

import (
	"slices"
	"testing"
)

func names(ps []namedPolicy) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.Name)
	}
	slices.Sort(out)
	return out
}

// topPolicies picks what RabbitMQ may apply to a quorum queue: the
// matching policies of highest priority whose apply-to covers quorum queues.
func TestTopPolicies(t *testing.T) {
	ps := []namedPolicy{
		{Name: "ours", Pattern: `^orders$`, ApplyTo: "queues", Priority: 10},
		{Name: "classic-only", Pattern: `.*`, ApplyTo: "classic_queues", Priority: 99},
		{Name: "exchanges", Pattern: `.*`, ApplyTo: "exchanges", Priority: 99},
		{Name: "other-queue", Pattern: `^payments$`, ApplyTo: "all", Priority: 50},
	}
	check := func(q string, want ...string) {
		t.Helper()
		if got := names(topPolicies(ps, q)); !slices.Equal(got, want) {
			t.Errorf("%s: got %q, want %q", q, got, want)
		}
	}
	check("orders", "ours")
	ps = append(ps, namedPolicy{Name: "operator", Pattern: `^ord`, ApplyTo: "quorum_queues", Priority: 11})
	check("orders", "operator")
	ps = append(ps, namedPolicy{Name: "a-tie", Pattern: `^ord`, ApplyTo: "all", Priority: 11})
	check("orders", "a-tie", "operator")
	check("shipping", "")
	// A pattern Go cannot compile (PCRE look-ahead) counts as matching.
	ps = []namedPolicy{{Name: "pcre", Pattern: `^(?!x)`, ApplyTo: "queues"}}
	check("orders", "pcre")
}
