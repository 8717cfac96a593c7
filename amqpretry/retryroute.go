package amqpretry

import (
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// retryRoute reports whether d reached its queue Q through one of the
// library's retry routes (route: retrymeta.DeliveryRetryRouteKey), and
// whether, moreover, the message is a copy the library published for Q, so
// that the attempt count and origin keys it carries were written by the
// library (copyOf: retrymeta.DeliveryRetryPathKey). The routes are:
//   - the loop-back exchange (zero-delay copies, fallback and redelivery
//     copies, poison-queue replays; Q is bound to it with routing key Q), or
//   - the default exchange with routing key Q, its most recent x-death
//     entry being reason "expired" in one of Q's wait queues (a wait queue
//     dead-letters through the default exchange to Q; with
//     DeadLetterFirstRetry Q's DLX also leads there), or
//   - a Config.DelayerFactory's mechanism: the Topology's
//     CustomDelayer.DeliveredQueue recognises the delivery's exchange and
//     routing key and names Q (the delay cascade: a level exchange or its
//     delivery exchange, and a cascade key ending in Q); or, without it, a
//     delivery shaped like one from a delay cascade (cascadeShaped), which
//     a deploy that left the cascade still receives.
//
// copyOf additionally needs an x-death without an entry for Q itself, or
// else copyBeforeDeath: a message dead-lettered out of Q (a nack with
// DeadLetterFirstRetry, a delivery limit, an overflow) since it was last
// published is the same message its last publisher sent, a copy of the
// library only if its first dead-lettering since says so; its x-death
// entries for Q are the broker's, and count (see amqpwire.XDeathSource). Q is d.RoutingKey on the first two routes, which
// deliver to the queue named by the routing key, and the queue
// DeliveredQueue names on the third. A message published straight to a
// business exchange never qualifies. (Anyone allowed to publish to the
// loop-back exchange, a cascade exchange, or to Q through the default
// exchange, can still set the origin exchange and routing key and the
// attempt count, never the origin queue: restrict those with RabbitMQ
// permissions.)
func (m Marshaler) retryRoute(d *amqp.Delivery, deaths []amqpwire.DeathRecord) (route, copyOf bool) {
	q := d.RoutingKey
	custom := false
	if m.Topology != nil && m.Topology.deliveredQueue != nil {
		if cq, ok := m.Topology.deliveredQueue(d.Exchange, d.RoutingKey); ok {
			q, custom = cq, true
		}
	}
	if !custom {
		if cq, ok := cascadeShaped(d, deaths); ok {
			q, custom = cq, true
		}
	}
	if q == "" {
		return false, false
	}
	loopBack := retrymeta.DefaultLoopBackExchange
	if m.Topology != nil {
		loopBack = m.Topology.Naming().LoopBackExchange
	}
	route = custom || d.Exchange == loopBack ||
		d.Exchange == "" && len(deaths) > 0 && deaths[0].Reason == "expired" && m.isWaitQueueOf(deaths[0].Queue, q)
	if !route {
		return false, false
	}
	for _, r := range deaths {
		if r.Queue == q {
			return true, m.copyBeforeDeath(d, q, loopBack)
		}
	}
	return true, true
}

// copyBeforeDeath reports whether a message dead-lettered out of q since it
// was last published (a DeadLetterFirstRetry nack, a delivery limit) was,
// when it was in q, a copy the library had published for q, from the
// broker's x-first-death-queue and x-first-death-exchange headers ("Dead
// Letter Exchanges": set at the first dead-lettering of a message without
// them). The library strips them from every copy it publishes, so they name
// the copy's first dead-lettering: in a wait queue of q or a cascade level
// (a delayed copy), or in q itself after arriving through the loop-back
// exchange (a zero-delay copy). A producer's message dead-lettered out of q
// has q and its business exchange there.
func (m Marshaler) copyBeforeDeath(d *amqp.Delivery, q, loopBack string) bool {
	fq, _ := d.Headers[retrymeta.XFirstDeathPrefix+"queue"].(string)
	fx, _ := d.Headers[retrymeta.XFirstDeathPrefix+"exchange"].(string)
	if fq == q {
		return fx == loopBack
	}
	if m.isWaitQueueOf(fq, q) {
		return true
	}
	_, level := cascadeLevelPrefix(fq)
	return level
}

// cascadeShaped recognises a delivery from a delay cascade (package
// amqpretry/cascade) that the Marshaler's Topology does not know, as after
// a deploy that switched a queue from the cascade to wait queues or native
// retry while copies were still waiting in the levels: its exchange is
// "<P>.level.NN" or "<P>.delivery", its most recent x-death entry is reason
// "expired" in level queue "<P>.level.MM" of the same prefix P, and its
// routing key is bit words "0"/"1" followed by the destination queue, which
// it returns. (A queue whose own name starts with a "0" or "1" word is cut
// short and not recognised.) Publishing such a delivery takes permissions on
// the cascade's exchanges and a dead-lettering by its level queue.
func cascadeShaped(d *amqp.Delivery, deaths []amqpwire.DeathRecord) (string, bool) {
	if len(deaths) == 0 || deaths[0].Reason != "expired" {
		return "", false
	}
	prefix, ok := cascadeLevelPrefix(deaths[0].Queue)
	if !ok {
		return "", false
	}
	if p, ok := cascadeLevelPrefix(d.Exchange); !(ok && p == prefix) && d.Exchange != prefix+".delivery" {
		return "", false
	}
	rest, bits := d.RoutingKey, 0
	for len(rest) > 2 && (rest[0] == '0' || rest[0] == '1') && rest[1] == '.' {
		rest, bits = rest[2:], bits+1
	}
	if bits == 0 || rest == "" {
		return "", false
	}
	return rest, true
}

// cascadeLevelPrefix returns P for a name "<P>.level.NN" (NN two digits).
func cascadeLevelPrefix(name string) (string, bool) {
	i := strings.LastIndex(name, ".level.")
	if i <= 0 {
		return "", false
	}
	nn := name[i+len(".level."):]
	if len(nn) != 2 || nn[0] < '0' || nn[0] > '9' || nn[1] < '0' || nn[1] > '9' {
		return "", false
	}
	return name[:i], true
}

// retryPathDelivery reports whether d is a copy the library published for
// its queue (see retryRoute).
func (m Marshaler) retryPathDelivery(d *amqp.Delivery, deaths []amqpwire.DeathRecord) bool {
	_, copyOf := m.retryRoute(d, deaths)
	return copyOf
}

// isWaitQueueOf reports whether name is one of queue's wait queues: by the
// Topology's names when set, or by the default naming "<queue>.wait.<tier>"
// with a tier as retrymeta.FormatDelay renders it ("200ms", "1s", "5m", "2h")
// for any tier, so that a copy waiting in the wait queue of a tier a later
// deploy removed (or of the tiers that a deploy replaced by a
// DelayerFactory) still counts as the library's when it comes back.
func (m Marshaler) isWaitQueueOf(name, queue string) bool {
	if m.Topology != nil {
		for _, w := range m.Topology.WaitQueues(queue) {
			if w == name {
				return true
			}
		}
	}
	tier, ok := strings.CutPrefix(name, queue+".wait.")
	if !ok {
		return false
	}
	i := strings.IndexFunc(tier, func(r rune) bool { return r < '0' || r > '9' })
	if i <= 0 {
		return false
	}
	switch tier[i:] {
	case "ms", "s", "m", "h":
		return true
	}
	return false
}
