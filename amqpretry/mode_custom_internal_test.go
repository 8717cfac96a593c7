package amqpretry

import (
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/amqpwire"
)

// retryPathDelivery with a DelayerFactory's recogniser: a delivery it
// recognises counts as a retry-path delivery for the queue it names, unless
// x-death shows the message was dead-lettered out of that queue.
func TestRetryPathDeliveryCustom(t *testing.T) {
	naming := Naming{}
	naming.setDefaults()
	topo := newTopology(naming, nil, QueueTypeClassic, false, nil)
	topo.deliveredQueue = func(exchange, key string) (string, bool) {
		if exchange != "delay.delivery" && exchange != "delay.level.03" {
			return "", false
		}
		q, ok := strings.CutPrefix(key, "0.1.")
		return q, ok && q != ""
	}
	m := Marshaler{Topology: topo}
	cases := []struct {
		name     string
		exchange string
		key      string
		deaths   []amqpwire.DeathRecord
		want     bool
	}{
		{"cascade delivery exchange", "delay.delivery", "0.1.Q", nil, true},
		{"cascade level exchange", "delay.level.03", "0.1.Q", []amqpwire.DeathRecord{{Queue: "delay.level.03", Reason: "expired", Count: 1}}, true},
		{"dead-lettered out of Q since", "delay.delivery", "0.1.Q", []amqpwire.DeathRecord{{Queue: "Q", Reason: "delivery_limit", Count: 1}}, false},
		{"not a cascade key", "delay.delivery", "Q", nil, false},
		{"business exchange", "orders", "0.1.Q", nil, false},
		{"loop-back still recognised", "rabbitretry.loopback", "Q", nil, true},
	}
	for _, tc := range cases {
		d := amqp.Delivery{Exchange: tc.exchange, RoutingKey: tc.key}
		if got := m.retryPathDelivery(&d, tc.deaths); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
	if tier := topo.TierFor(1); tier != 0 {
		t.Errorf("TierFor without tiers = %v, want 0", tier)
	}
	if tier, ok := topo.tierAtLeast(1); tier != 0 || ok {
		t.Errorf("TierAtLeast without tiers = %v, %v; want 0, false", tier, ok)
	}
}
