package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
)

// defaultFullWait is the default of Config.FullWait.
const defaultFullWait = 30 * time.Second

// Defaults of Config.
const (
	// DefaultPrefix starts every exchange and queue name of the cascade.
	DefaultPrefix = "rabbitretry.delay"
	// DefaultGrain is the default time unit of the cascade: 100 ms.
	DefaultGrain = 100 * time.Millisecond
	// maxLevels bounds Config.Levels: with the smallest grain (1 ms), level
	// 31's TTL is 2^31 ms, and 2^32 ms would exceed amqpretry.MaxTTL.
	maxLevels = 32
	// levelDeliveryLimit is the x-delivery-limit argument quorum level
	// queues are declared with: 2^31-1 returns, i.e. never reached. A level
	// queue has no consumer except Census, and an interrupted census (its
	// connection dropped, a deadline, Ctrl-C) returns every delivery it
	// held, which RabbitMQ 4.x counts against the queue's delivery limit
	// (default 20 since 4.0; "Quorum Queues", poison message handling): a
	// message over the limit is dead-lettered to the next level, i.e.
	// delivered early. A large finite value, not -1: a negative limit
	// means "unlimited" on 4.x but acts as 0 (drop after one delivery) on
	// 3.x, and an argument at declaration is the proven-safe way to set it
	// (a policy is not needed).
	levelDeliveryLimit = 1<<31 - 1
	// defaultTopologyCheck is the default of Config.TopologyCheck: 5 s.
	defaultTopologyCheck = 5 * time.Second
)

// ErrSettingsMismatch is returned (wrapped) by Declare when the cascade's
// prefix is already declared with another Levels, Grain or QueueType: both
// settings are named in the error. Two processes declaring one prefix with
// different Levels would bind each level twice with different patterns
// (duplicates and early deliveries, for good: bindings are durable).
var ErrSettingsMismatch = errors.New("cascade: the cascade is already declared with other settings")

// Config configures the delay cascade. The zero value is usable: zero
// fields take the defaults given. Every process sharing a vhost's cascade
// must use the same Prefix, Grain, Levels and QueueType (the broker refuses
// a redeclare with other arguments: PRECONDITION_FAILED, returned as an
// *amqpretry.DeclareError naming the argument).
type Config struct {
	// Prefix starts every name: exchanges and queues "<Prefix>.level.NN"
	// (NN = 00 .. Levels-1, two digits) and the delivery exchange
	// "<Prefix>.delivery". Default DefaultPrefix ("rabbitretry.delay").
	// Must not start with "amq." (reserved, RabbitMQ "Exchanges"); at most
	// 245 bytes (names are limited to 255).
	Prefix string
	// Grain is the cascade's time unit: a delay is rounded up to a whole
	// number of grains, and level n's queue holds messages 2^n grains
	// (x-message-ttl, in ms, RabbitMQ "Time-To-Live and Expiration").
	// Default DefaultGrain (100 ms). Must be a whole number of milliseconds,
	// at least 1 ms.
	Grain time.Duration
	// Levels is the number of levels, i.e. of bits in a delay: MaxDelay is
	// (2^Levels - 1) × Grain. Default: the fewest levels whose MaxDelay
	// covers amqpretry.MaxTTL (2^32-1 ms, about 49.7 days) while level
	// Levels-1's TTL stays within it: 26 for 100 ms (MaxDelay about 77.7
	// days), 23 for 1 s, 32 for 1 ms. Range [1, 32], with
	// 2^(Levels-1) × Grain <= amqpretry.MaxTTL (RabbitMQ refuses a larger
	// x-message-ttl).
	Levels int
	// QueueType of the level queues: amqpretry.QueueTypeQuorum (default) or
	// amqpretry.QueueTypeClassic. Quorum level queues dead-letter
	// at-least-once (x-dead-letter-strategy at-least-once, which needs
	// x-overflow reject-publish; RabbitMQ 3.10+, "Quorum Queues"): a
	// message is removed from a level only once the next level's queue (or
	// the destination) confirmed it, so no broker crash or restart loses
	// it. Classic queues dead-letter at-most-once ("Dead Letter
	// Exchanges"): a message in transit between levels is lost if the node
	// stops; use them only where that is acceptable (they are cheaper).
	QueueType string
	// Publisher publishes the delayed messages (mandatory, with publisher
	// confirms) and opens the channels for declarations. Set it, or URI.
	// NewDelayer and NewPublisher do not close it.
	Publisher *confirm.Publisher
	// URI, when Publisher is nil, is the AMQP URI NewDelayer and
	// NewPublisher dial their own confirm.Publisher with (closed by Close).
	// Setting both Publisher and URI is an error.
	URI string
	// Marshaler converts watermill messages to AMQP publishings. Its zero
	// value is ready (amqpretry.Marshaler{}); use the subscriber's.
	Marshaler amqpretry.Marshaler
	// QueueName maps a message's context to its destination queue, for the
	// Delayer (a retry goes back to the queue the message was consumed
	// from). Default: message.SubscribeTopicFromCtx(ctx), i.e. the router's
	// subscribe topic, which is the queue name with watermill-amqp's
	// durable-queue configs. Not used by the Publisher (the topic is the
	// queue).
	QueueName func(ctx context.Context) string
	// Logger receives warnings (a clamped delay, a redeclared topology).
	// Default watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
	// TopologyCheck is how often a Delayer or Publisher that has declared
	// the cascade checks that it is still there: the settings marker, the
	// delivery exchange and every level's exchange and queue (passive
	// declares, 2 × Levels + 2 reads on one channel, no writes). If one is
	// missing (an operator deleted it, or a tool like `rabbitmqctl
	// delete_queue`), it logs an error, declares the whole cascade again
	// (Declare, idempotent: it also restores the bindings deleted with it)
	// and binds again every destination it has bound. A deleted level
	// queue, level exchange or delivery exchange is thus back within about
	// TopologyCheck, and messages that expire after that find their route.
	// Messages whose dead-lettering found no route before that wait in the
	// previous quorum level's dead-letter buffer until RabbitMQ's
	// at-least-once dead-letter worker retries them (every
	// dead_letter_worker_publisher_confirm_timeout, 3 min by default;
	// classic levels drop them), unless ManagementURL is set: then the
	// repair has the workers resend at once (see ManagementURL). Default
	// 5 s;
	// negative disables the check. A bare binding removed on its own is
	// not seen (AMQP cannot read bindings); Declare restores it.
	TopologyCheck time.Duration
	// ManagementURL, when set, is the base URL of the RabbitMQ management
	// HTTP API ("Management Plugin", HTTP API), with credentials, e.g.
	// "http://guest:guest@127.0.0.1:15672" (the password is sent as basic
	// auth and never shown in errors or logs). With it, Waiting also
	// reports each level's dead-letter backlog and length limits
	// (LevelCount.DeadLettering, LevelCount.LengthLimit), the topology
	// check logs an error for a level queue with a length limit, and after
	// repairing a deleted piece (TopologyCheck) it has the quorum levels'
	// dead-letter workers resend their buffers at once instead of at their
	// next resend (3 min): it applies a policy named
	// "<Prefix>.dead-letter-retry" to the level queues (priority 2^20,
	// definition dead-letter-strategy at-least-once, which their arguments
	// already set) and deletes it again; a policy change makes each quorum
	// queue's worker look its dead-letter exchange up again and resend
	// ("Policies"; rabbit_fifo_dlx_worker). For that moment it replaces
	// any other policy on the level queues, and the user needs the
	// policymaker (or administrator) tag; without it the repair logs an
	// error and the messages arrive at the next resend. Default "" (no
	// management API: DeadLettering is -1, LengthLimit unknown).
	ManagementURL string
	// Vhost is the cascade's virtual host, for ManagementURL only (AMQP
	// uses the connection's). Default "/".
	Vhost string
	// FullWait bounds how long Schedule and Publish hold a message that a
	// full level queue refused (a length limit from a policy or operator
	// policy, "Queue Length Limit": quorum levels overflow with
	// reject-publish, so the broker answers basic.nack). The caller's
	// message stays unacknowledged meanwhile. The held message is
	// published again, with what is left of its delay (never less: its due
	// time is fixed when it is first sent), after 100 ms, then at doubling
	// pauses up to 1 s, and at its due time at the latest, when it goes
	// straight to its destination: so it arrives on time if the level has
	// room again, or its delay ends, within FullWait. After FullWait the
	// last refusal is returned (wrapping confirm.ErrNacked). A message
	// due within FullWait whose way crosses a level known full (it refused
	// a publish and has not shown room since, or the management API shows
	// it at its max-length) is held the same way without being sent: a
	// full level would refuse it from the level above, where it would wait
	// minutes (see LevelCount.Full). Default 30 s; negative: no hold (a
	// refusal is returned at once, nothing is held). The
	// Delayer's hold, like its publish, does not end with the router's
	// context (a retry in flight is not dropped at shutdown), so a router
	// stopping while a level is full may wait up to FullWait; the
	// Publisher's ends with the message's context.
	FullWait time.Duration

	// legacyLevels: the level queues were declared by a version without
	// x-delivery-limit (set by the Delayer/Publisher after the broker
	// refused the new argument); declare them as they are.
	legacyLevels bool
}

func (c *Config) setDefaults() {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.Grain == 0 {
		c.Grain = DefaultGrain
	}
	if c.Levels == 0 && c.Grain >= time.Millisecond && c.Grain <= amqpretry.MaxTTL {
		c.Levels = defaultLevels(c.Grain)
	}
	if c.QueueType == "" {
		c.QueueType = amqpretry.QueueTypeQuorum
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.TopologyCheck == 0 {
		c.TopologyCheck = defaultTopologyCheck
	}
	if c.FullWait == 0 {
		c.FullWait = defaultFullWait
	}
}

// defaultLevels returns the fewest levels whose max delay covers MaxTTL,
// one fewer if the top level's TTL would then exceed MaxTTL.
func defaultLevels(grain time.Duration) int {
	n := 1
	for n < maxLevels && time.Duration(uint64(1)<<uint(n)-1)*grain < amqpretry.MaxTTL {
		n++
	}
	if levelTTL(grain, n-1) > amqpretry.MaxTTL && n > 1 {
		n--
	}
	return n
}

// levelTTL is level n's queue TTL: 2^n × grain.
func levelTTL(grain time.Duration, n int) time.Duration {
	return time.Duration(uint64(1)<<uint(n)) * grain
}

// Validate reports the first invalid field, by name: Prefix reserved or too
// long, Grain not a positive whole number of milliseconds, Levels outside
// [1, 32] or with a top-level TTL above amqpretry.MaxTTL, QueueType
// neither quorum nor classic, both Publisher and URI set, or a
// ManagementURL that is not an http(s) URL (shown without its password).
// Zero fields are valid (defaults); NewDelayer and NewPublisher apply them
// first.
func (c Config) Validate() error {
	c.setDefaults()
	if strings.HasPrefix(c.Prefix, "amq.") {
		return fmt.Errorf("cascade.Config.Prefix %q starts with \"amq.\", which RabbitMQ reserves", c.Prefix)
	}
	if len(c.Prefix) > 245 {
		return fmt.Errorf("cascade.Config.Prefix has %d bytes, more than 245 (names are limited to 255)", len(c.Prefix))
	}
	if c.Grain < time.Millisecond || c.Grain%time.Millisecond != 0 {
		return fmt.Errorf("cascade.Config.Grain %v is not a positive whole number of milliseconds (x-message-ttl is in ms)", c.Grain)
	}
	if c.Levels < 1 || c.Levels > maxLevels {
		return fmt.Errorf("cascade.Config.Levels %d is outside [1, %d]", c.Levels, maxLevels)
	}
	if top := levelTTL(c.Grain, c.Levels-1); top > amqpretry.MaxTTL {
		return fmt.Errorf("cascade.Config.Levels %d with Grain %v makes the top level's TTL %v, above RabbitMQ's maximum %v",
			c.Levels, c.Grain, top, amqpretry.MaxTTL)
	}
	if c.QueueType != amqpretry.QueueTypeQuorum && c.QueueType != amqpretry.QueueTypeClassic {
		return fmt.Errorf("cascade.Config.QueueType %q is neither %q nor %q", c.QueueType, amqpretry.QueueTypeQuorum, amqpretry.QueueTypeClassic)
	}
	if c.Publisher != nil && c.URI != "" {
		return errors.New("cascade.Config: both Publisher and URI are set; set one")
	}
	if _, err := c.managementClient(); err != nil {
		return err
	}
	return nil
}

// resolved returns c with defaults, validated.
func (c Config) resolved() (Config, error) {
	c.setDefaults()
	return c, c.Validate()
}

// LevelName is the name of level n's exchange and of its queue (the same
// string names both; exchanges and queues are separate namespaces):
// "<Prefix>.level.NN", NN two digits.
func (c Config) LevelName(n int) string {
	c.setDefaults()
	return fmt.Sprintf("%s.level.%02d", c.Prefix, n)
}

// DeliveryExchange is the name of the topic exchange the last level
// dead-letters to, and the destinations are bound to: "<Prefix>.delivery".
func (c Config) DeliveryExchange() string {
	c.setDefaults()
	return c.Prefix + ".delivery"
}

// FirstExchange is the top level's exchange, "<Prefix>.level.<Levels-1>":
// any cascade routing key published there reaches its destination after
// its delay. The Delayer and Publisher publish to EntryExchange instead,
// which skips the levels whose bit is 0 above the highest set bit.
func (c Config) FirstExchange() string {
	c.setDefaults()
	return c.LevelName(c.Levels - 1)
}

// EntryExchange is the exchange a message delayed by n grains is published
// to: the exchange of the level of n's highest set bit (every level above
// it would only pass the message on, bit 0, through an exchange-to-exchange
// binding), or the delivery exchange for n = 0. Entering there routes
// exactly as entering at FirstExchange does, with fewer exchanges to pass:
// on RabbitMQ 4.3.6 raw confirmed publishes of cascade keys ran at ~14,000
// msg/s into the highest set bit's exchange against ~3,400 msg/s into the
// top one (examples/bench, cascade routing probe).
func (c Config) EntryExchange(n uint64) string {
	c.setDefaults()
	if n == 0 {
		return c.DeliveryExchange()
	}
	return c.LevelName(bits.Len64(n) - 1)
}

// nextExchange is where level n passes (bit 0) and dead-letters to.
func (c *Config) nextExchange(n int) string {
	if n == 0 {
		return c.DeliveryExchange()
	}
	return c.LevelName(n - 1)
}

// levelPatterns returns level n's binding keys: the one matching keys whose
// bit n is 1 (to the level queue) and the one for bit n 0 (to the next
// exchange). Bit n is word Levels-1-n of the key (0-based).
func (c *Config) levelPatterns(n int) (one, zero string) {
	skip := strings.Repeat("*.", c.Levels-1-n)
	return skip + "1.#", skip + "0.#"
}

// destinationPattern is queue's binding key on the delivery exchange: one
// "*" per level, then the queue name word for word, so it matches that
// queue's keys only (a "#." prefix would also match queue "b" for "a.b").
func (c *Config) destinationPattern(queue string) string {
	return strings.Repeat("*.", c.Levels) + queue
}

// levelArgs are level n's queue arguments.
func (c *Config) levelArgs(n int) amqp.Table {
	args := amqp.Table{
		"x-queue-type":           c.QueueType,
		"x-message-ttl":          levelTTL(c.Grain, n).Milliseconds(),
		"x-dead-letter-exchange": c.nextExchange(n),
	}
	if c.QueueType == amqpretry.QueueTypeQuorum {
		args["x-dead-letter-strategy"] = "at-least-once"
		args["x-overflow"] = "reject-publish"
		if !c.legacyLevels {
			args["x-delivery-limit"] = int64(levelDeliveryLimit)
		}
	}
	return args
}
