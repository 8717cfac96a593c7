package amqpretry

import (
	"fmt"
	"strconv"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
)

// checkNativeSupport refuses the native mode on a broker older than 4.3,
// from the server's "version" connection property. Before 4.3 the broker
// accepts the x-delayed-retry-* arguments silently and ignores them, so a
// declare cannot tell: every nack would requeue at once (a hot loop).
func checkNativeSupport(props amqp.Table) error {
	v, _ := props["version"].(string)
	major, minor, ok := parseMajorMinor(v)
	if !ok {
		return fmt.Errorf("amqpretry: Config.Mode NativeDelayed needs RabbitMQ 4.3 or later, and the broker's version %q cannot be read; use Mode Tiers, or DeadLetterFirst on quorum queues", v)
	}
	if major < 4 || (major == 4 && minor < 3) {
		return fmt.Errorf("amqpretry: Config.Mode NativeDelayed needs RabbitMQ 4.3 or later (quorum-queue delayed retry), and the broker is %s, which ignores the x-delayed-retry-* arguments (nacked messages would come back at once); use Mode Tiers, or DeadLetterFirst on quorum queues", v)
	}
	return nil
}

// parseMajorMinor reads "4.3.6", "4.3.0-rc.1", "4.3" and the like.
func parseMajorMinor(v string) (major, minor int, ok bool) {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return 0, 0, false
	}
	lead := func(s string) (int, bool) {
		i := 0
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		n, err := strconv.Atoi(s[:i])
		return n, err == nil
	}
	major, ok1 := lead(parts[0])
	minor, ok2 := lead(parts[1])
	return major, minor, ok1 && ok2
}

// serverProperties returns the broker's connection properties, from the
// retry publisher's connection.
func serverProperties(p *confirm.Publisher) (amqp.Table, error) {
	c, err := p.Connection()
	if err != nil {
		return nil, err
	}
	return c.Properties, nil
}

// acquiredCount converts an x-acquired-count value like x-delivery-count.
func acquiredCount(v interface{}) (int64, error) {
	return wire.Count(retrymeta.XAcquiredCountKey, v)
}
