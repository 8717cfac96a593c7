package cascadecore

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// maxRoutingKeyBytes is the longest routing key AMQP 0-9-1 carries (a
// short string). A cascade key takes 2 bytes per level ("0." or "1.") plus
// the destination queue name, so with Levels levels a destination name may
// have at most maxRoutingKeyBytes - 2×Levels bytes (203 with the default 26).
const maxRoutingKeyBytes = 255

// errBadRoutingKey is wrapped by parseRoutingKey for a key that is not a
// cascade key of this Config (wrong number of bit words, a word other than
// "0" or "1", or no queue name).
var errBadRoutingKey = errors.New("cascade: not a delay cascade routing key")

// ErrBadQueueName is wrapped by RoutingKey, BindDestination, the Delayer and
// the Publisher for a destination queue name the cascade cannot route to:
// empty, too long for the routing key (see maxRoutingKeyBytes), or with a
// dot-separated word that is exactly "*" or "#" (a topic-exchange wildcard,
// RabbitMQ "Exchanges" / topic exchange: the binding would match other
// queues' keys).
var ErrBadQueueName = errors.New("cascade: queue name cannot be routed by the delay cascade")

// MaxDelay returns the longest delay the cascade holds: (2^Levels - 1) ×
// Grain, the time a key with every bit set spends in the level queues.
// With the defaults (100 ms grain, 26 levels) it is 6,710,886.3 s, about
// 77.7 days, above amqpretry.MaxTTL (2^32-1 ms, about 49.7 days). It
// returns Validate's error for an invalid Config.
func (c Config) MaxDelay() (time.Duration, error) {
	c.setDefaults()
	if err := c.Validate(); err != nil {
		return 0, err
	}
	return c.maxDelay(), nil
}

func (c *Config) maxDelay() time.Duration {
	return time.Duration(uint64(1)<<uint(c.Levels)-1) * c.Grain
}

// Grains returns delay in grains rounded up, the number the routing key
// encodes: 0 for delay <= 0, else ceil(delay / Grain). The message is never
// delivered earlier than asked (apart from the broker's own clock
// granularity, see the package doc). ok is false when the count exceeds
// 2^Levels - 1 (delay > MaxDelay).
func (c *Config) grains(delay time.Duration) (n uint64, ok bool) {
	if delay <= 0 {
		return 0, true
	}
	n = uint64(delay / c.Grain)
	if delay%c.Grain != 0 {
		n++
	}
	return n, n <= uint64(1)<<uint(c.Levels)-1
}

// RoutingKey returns the cascade routing key that delivers to queue after
// delay (see the package doc for the encoding): Levels words "0" or "1",
// the bits of ceil(delay / Grain) most significant first, then queue, all
// joined by ".". A delay <= 0 gives the all-zero key (immediate delivery).
// Errors: Validate's, ErrBadQueueName (wrapped) for an unroutable queue
// name, or an error for a delay above MaxDelay (the Delayer clamps such a
// delay instead; the Publisher refuses it).
func (c Config) RoutingKey(delay time.Duration, queue string) (string, error) {
	c.setDefaults()
	if err := c.Validate(); err != nil {
		return "", err
	}
	n, ok := c.grains(delay)
	if !ok {
		return "", fmt.Errorf("cascade: delay %v exceeds the maximum %v", delay, c.maxDelay())
	}
	return c.routingKey(n, queue)
}

// routingKey encodes n grains for queue; c has its defaults.
func (c *Config) routingKey(n uint64, queue string) (string, error) {
	if err := c.checkQueue(queue); err != nil {
		return "", err
	}
	var b strings.Builder
	b.Grow(2*c.Levels + len(queue))
	for bit := c.Levels - 1; bit >= 0; bit-- {
		if n>>uint(bit)&1 == 1 {
			b.WriteString("1.")
		} else {
			b.WriteString("0.")
		}
	}
	b.WriteString(queue)
	return b.String(), nil
}

// checkQueue reports ErrBadQueueName for a name the cascade cannot route.
func (c *Config) checkQueue(queue string) error {
	if queue == "" {
		return fmt.Errorf("%w: empty queue name", ErrBadQueueName)
	}
	if limit := maxRoutingKeyBytes - 2*c.Levels; len(queue) > limit {
		return fmt.Errorf("%w: %q has %d bytes, more than the %d left in a routing key by %d levels",
			ErrBadQueueName, queue, len(queue), limit, c.Levels)
	}
	for _, w := range strings.Split(queue, ".") {
		if w == "*" || w == "#" {
			return fmt.Errorf("%w: %q has a word %q, a topic-exchange wildcard", ErrBadQueueName, queue, w)
		}
	}
	return nil
}

// parseRoutingKey inverts RoutingKey, for operators reading a message's
// routing key (or its x-death routing-keys) in a level queue: it returns
// the delay the key encodes (a whole number of grains) and the destination
// queue. It does not say how much of the delay is left: that depends on
// which level queue the message is in (the bits of the lower levels). It
// returns Validate's error, or errBadRoutingKey (wrapped).
func (c Config) parseRoutingKey(key string) (delay time.Duration, queue string, err error) {
	c.setDefaults()
	if err := c.Validate(); err != nil {
		return 0, "", err
	}
	n, queue, err := c.parseKey(key)
	if err != nil {
		return 0, "", err
	}
	return time.Duration(n) * c.Grain, queue, nil
}

// parseKey returns the grain count and queue of a cascade key.
func (c *Config) parseKey(key string) (n uint64, queue string, err error) {
	rest := key
	for i := 0; i < c.Levels; i++ {
		if len(rest) < 2 || rest[1] != '.' || (rest[0] != '0' && rest[0] != '1') {
			return 0, "", fmt.Errorf("%w: %q: word %d is not \"0\" or \"1\" followed by \".\" (%d levels)", errBadRoutingKey, key, i+1, c.Levels)
		}
		n = n<<1 | uint64(rest[0]-'0')
		rest = rest[2:]
	}
	if rest == "" {
		return 0, "", fmt.Errorf("%w: %q has no queue name after its %d bits", errBadRoutingKey, key, c.Levels)
	}
	return n, rest, nil
}

// deliveredQueue reports whether a delivery with this exchange and routing
// key (basic.deliver's) came out of the cascade and, if so, which queue it
// was addressed to and the delay its key encoded. A marshaler can use it to
// recognise delayed copies, whose routing key is not the queue name.
//
// The delivery's exchange is the one the message entered its last routing
// through, not the delivery exchange: exchange-to-exchange bindings do not
// rename it ("Exchange to Exchange Bindings"), and a dead-lettered message
// is published to its queue's dead-letter exchange ("Dead Letter
// Exchanges"). So it is level n-1's exchange when the lowest set bit of the
// key is n (the delivery exchange for n = 0, or for a zero delay).
// deliveredQueue accepts any level exchange or the delivery exchange with
// a well-formed key. It returns ok false for an invalid Config.
func (c Config) deliveredQueue(exchange, routingKey string) (queue string, delay time.Duration, ok bool) {
	c.setDefaults()
	if c.Validate() != nil || !c.isCascadeExchange(exchange) {
		return "", 0, false
	}
	n, q, err := c.parseKey(routingKey)
	if err != nil {
		return "", 0, false
	}
	return q, time.Duration(n) * c.Grain, true
}

// isCascadeExchange: the delivery exchange or "<Prefix>.level.NN" with
// NN < Levels.
func (c *Config) isCascadeExchange(exchange string) bool {
	if exchange == c.DeliveryExchange() {
		return true
	}
	nn, ok := strings.CutPrefix(exchange, c.Prefix+".level.")
	if !ok || len(nn) != 2 || nn[0] < '0' || nn[0] > '9' || nn[1] < '0' || nn[1] > '9' {
		return false
	}
	return int(nn[0]-'0')*10+int(nn[1]-'0') < c.Levels
}
