package cascade

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/cascadecore"
)

// Config configures the delay cascade. The zero value is usable: zero
// fields take the defaults given. Every process sharing a vhost's cascade
// must use the same Prefix, Grain, Levels and QueueType (the broker refuses
// a redeclare with other arguments: PRECONDITION_FAILED, returned as an
// *amqpretry.DeclareError naming the argument).
type Config struct {
	// Prefix starts every name: exchanges and queues "<Prefix>.level.NN"
	// (NN = 00 .. Levels-1, two digits) and the delivery exchange
	// "<Prefix>.delivery". Default "rabbitretry.delay".
	// Must not start with "amq." (reserved, RabbitMQ "Exchanges"); at most
	// 245 bytes (names are limited to 255).
	Prefix string
	// Grain is the cascade's time unit: a delay is rounded up to a whole
	// number of grains, and level n's queue holds messages 2^n grains
	// (x-message-ttl, in ms, RabbitMQ "Time-To-Live and Expiration").
	// Default 100 ms. Must be a whole number of milliseconds,
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
	// NewPublisher and Mode do not close it (Mode needs it empty: it
	// uses the Retry's).
	Publisher *confirm.Publisher
	// URI, when Publisher is nil, is the AMQP URI NewPublisher dials its
	// own confirm.Publisher with (closed by Close).
	// Setting both Publisher and URI is an error.
	URI string
	// Marshaler converts watermill messages to AMQP publishings. Its zero
	// value is ready (amqpretry.Marshaler{}); use the subscriber's.
	Marshaler amqpretry.Marshaler
	// QueueName maps a message's context to its destination queue, for the
	// retry Delayer of Mode (a retry goes back to the queue the message was consumed
	// from). Default: message.SubscribeTopicFromCtx(ctx), i.e. the router's
	// subscribe topic, which is the queue name with watermill-amqp's
	// durable-queue configs. Not used by the Publisher (the topic is the
	// queue).
	QueueName func(ctx context.Context) string
	// Logger receives warnings (a clamped delay, a redeclared topology).
	// Default watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
	// TopologyCheck is how often Mode's Delayer or a Publisher that has declared
	// the cascade checks that it is still there: the settings marker, the
	// delivery exchange and every level's exchange and queue (passive
	// declares, 2 × Levels + 2 reads on one channel, no writes). If one is
	// missing (an operator deleted it, or a tool like `rabbitmqctl
	// delete_queue`), it logs an error, declares the whole cascade again
	// (idempotent: it also restores the bindings deleted with it)
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
	// not seen (AMQP cannot read bindings); the next declare restores it.
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
}

// core is c as the cascade's machinery takes it.
func (c Config) core() cascadecore.Config {
	return cascadecore.Config{
		Prefix: c.Prefix, Grain: c.Grain, Levels: c.Levels, QueueType: c.QueueType,
		Publisher: c.Publisher, URI: c.URI, Marshaler: c.Marshaler, QueueName: c.QueueName,
		Logger: c.Logger, TopologyCheck: c.TopologyCheck, ManagementURL: c.ManagementURL,
		Vhost: c.Vhost, FullWait: c.FullWait,
	}
}

// Validate reports the first invalid field, by name ("cascade.Config.Levels
// 40 is outside [1, 32]"): Prefix reserved ("amq.") or longer than 245
// bytes, Grain not a positive whole number of milliseconds, Levels outside
// [1, 32] or with a top-level TTL above amqpretry.MaxTTL, QueueType
// neither quorum nor classic, both Publisher and URI set, or a
// ManagementURL that is not an http(s) URL (shown without its password).
// Zero fields are valid (defaults); Mode and NewPublisher apply them first.
func (c Config) Validate() error { return c.core().Validate() }

// Waiting reports, per level (level 0 first), how many messages wait in
// the level queue, with a passive queue.declare each on ch. A message is
// counted in the level it is in now; counts per destination queue, with
// due times, come from `rabbitretry-topology cascade census`, which has to
// consume them. A ready count does not include the level's dead-letter
// backlog (messages that expired and are not yet in the next level): with
// ManagementURL set, Waiting reads it (and length limits) from the
// management API, one GET for all levels (LevelCount.DeadLettering,
// LengthLimit); without, DeadLettering is -1. It returns Validate's error,
// ctx's error (checked between declares), the broker's error (a missing
// level queue: 404 NOT_FOUND, which closes ch), or the management API's
// error (with the counts read so far).
func (c Config) Waiting(ctx context.Context, ch *amqp.Channel) ([]LevelCount, error) {
	counts, err := c.core().Waiting(ctx, ch)
	return levelCounts(counts), err
}

func levelCounts(in []cascadecore.LevelCount) []LevelCount {
	if in == nil {
		return nil
	}
	out := make([]LevelCount, len(in))
	for i, lc := range in {
		out[i] = LevelCount(lc)
	}
	return out
}

// Mode is the retry mode (amqpretry.Config.Mode) that makes amqpretry.New
// schedule its retries through the delay cascade instead of per-queue wait
// queues (an amqpretry.Custom mode):
//
//	retry, err := amqpretry.New(amqpretry.Config{
//		Subscriber: wamqp.NewDurableQueueConfig(uri),
//		Mode:       cascade.Mode(cascade.Config{}),
//	})
//
// A retry then waits exactly its delay, max(computed backoff, the handler's
// middleware.RetryAfter), rounded up to cfg.Grain (100 ms by default), in
// the vhost's shared level queues, and comes back to its originating queue
// Q only; no wait queue is declared for Q.
//
// cfg.Publisher and cfg.URI must be empty: the Delayer publishes with the
// Retry's publisher. cfg.Marshaler (if zero), cfg.QueueName and cfg.Logger
// (if nil) default to the Retry's, so a retry goes back to the queue
// amqpretry.Config.QueueName names. Prefix, Grain, Levels and QueueType
// keep their Config defaults and must match every other process using the
// vhost's cascade.
//
// Topology: on every subscriber (re)connect, the topology builder declares
// the cascade (idempotent) and binds Q to the delivery exchange on the
// subscriber's channel, so a recreated Q is bound again before it
// consumes; a refused declare (a cascade declared elsewhere with other
// arguments: PRECONDITION_FAILED, an *amqpretry.DeclareError) makes the
// subscriber fail to start. The Marshaler recognises a delivery from the
// cascade (a level exchange or the delivery exchange, and a cascade key)
// as a retry-path delivery, so the origin metadata recorded on the first
// failure (middleware.OriginalQueueKey = Q, ...) is kept.
//
// Copies with no delay (the fallback's and the RedeliveryGuard's) do not
// use the cascade: amqpretry sends them through its loop-back exchange.
// amqpretry.New returns (wrapped) Validate's error, or an error if
// Publisher or URI is set.
func Mode(cfg Config) amqpretry.Mode { return cascadecore.Mode(cfg.core()) }

// Publisher is a watermill message.Publisher that delivers each message to
// the queue named by the topic after the delay set by Watermill's delay
// component (github.com/ThreeDotsLabs/watermill/components/delay:
// delay.Message(msg, delay.For(d)), delay.Until(t), or delay.WithContext
// through a delay.NewPublisher wrapping this one; and
// router/middleware.DelayOnError), through the delay cascade. A message
// without delay metadata is delivered at once. Safe for concurrent use.
//
// So on RabbitMQ, scheduled messages and DelayOnError work without the
// delayed-message exchange plugin: for DelayOnError, use a Publisher as the
// PoisonQueue middleware's publisher and the consumer's queue as its topic.
type Publisher struct {
	p *cascadecore.Publisher
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher for cfg (defaults applied). With
// cfg.Publisher set it uses that publisher (an amqpretry.Retry's
// Publisher(), say) and never closes it; with cfg.URI it dials its own,
// closed by Close. It declares nothing yet: the cascade is declared on the
// first Publish or Bind, and each destination queue is bound on its first
// use. Errors: Validate's, neither Publisher nor URI set, or the dial
// error.
func NewPublisher(cfg Config) (*Publisher, error) {
	p, err := cascadecore.NewPublisher(cfg.core())
	if err != nil {
		return nil, err
	}
	return &Publisher{p: p}, nil
}

// Publish publishes each message, in order, to the cascade with its delay
// and topic as the destination queue, and returns once the broker
// confirmed it (mandatory, publisher confirms, under the message's
// context). The delay comes from the metadata of Watermill's delay
// component (delay.DelayedUntilKey, an RFC 3339 time, and
// delay.DelayedForKey, a Go duration; when both are present, the earlier
// of the two, never early), rounded up to the grain; none: delivered at
// once. The first publish to a topic binds its queue, which must exist.
// The delay metadata stays on the message (its consumer sees it).
//
// Errors, stopping at the first failed message (the earlier ones are
// published): unreadable delay metadata; ErrDelayTooLong (wrapped); a
// topic the cascade cannot route (ErrBadQueueName); a declare or bind
// error (*amqpretry.DeclareError, e.g. 404 for a missing queue); or the
// publisher's (confirm.ErrNacked, ErrConfirmTimeout, ...).
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	return p.p.Publish(topic, msgs...)
}

// Bind declares the cascade (if this Publisher has not yet) and binds
// queue to it now (always: bindings are idempotent), instead of on the
// first Publish to queue. Call it at startup to fail early (a missing
// queue, a cascade declared with other arguments), and after recreating a
// queue: the Publisher binds each queue once per process, and a deleted
// queue loses its binding. Errors: ErrBadQueueName (wrapped),
// *amqpretry.DeclareError, or the publisher's channel error.
func (p *Publisher) Bind(queue string) error { return p.p.Bind(queue) }

// Waiting reports per level how many messages wait (see Config.Waiting),
// on a channel of the Publisher's publisher, with each level's Full and
// Refused as this Publisher saw them.
func (p *Publisher) Waiting(ctx context.Context) ([]LevelCount, error) {
	counts, err := p.p.Waiting(ctx)
	return levelCounts(counts), err
}

// Close closes the publisher if NewPublisher dialled it (Config.URI); a
// Config.Publisher is left open.
func (p *Publisher) Close() error { return p.p.Close() }

// Errors the cascade returns (wrapped), for errors.Is.
var (
	// ErrSettingsMismatch: the cascade's prefix is already declared with
	// another Levels, Grain or QueueType (both settings are named in the
	// error). Two processes declaring one prefix with different Levels
	// would bind each level twice with different patterns (duplicates and
	// early deliveries, for good: bindings are durable).
	ErrSettingsMismatch = cascadecore.ErrSettingsMismatch
	// ErrDelayTooLong: Publisher.Publish got a message scheduled further
	// ahead than the cascade's maximum delay, (2^Levels - 1) × Grain:
	// delivering it then would be early, so it is refused (retries through
	// Mode, which may come back early, are clamped instead).
	ErrDelayTooLong = cascadecore.ErrDelayTooLong
	// ErrBadQueueName: a destination queue name the cascade cannot route
	// to: empty, too long for the routing key (255 bytes, less two per
	// level), or with a dot-separated word that is exactly "*" or "#" (a
	// topic-exchange wildcard: the binding would match other queues'
	// keys).
	ErrBadQueueName = cascadecore.ErrBadQueueName
)

// LevelCount is what Waiting reports for one level.
type LevelCount struct {
	// Level is n: the queue holds messages 2^n grains.
	Level int
	// Queue is the level queue's name.
	Queue string
	// TTL is the level queue's x-message-ttl: 2^n × Grain.
	TTL time.Duration
	// Messages is the number of messages ready in the queue, as queue.declare
	// (passive) reports it ("Queues", passive declare): messages waiting
	// out this level's TTL. Level queues have no consumers, so none are
	// unacknowledged; a quorum queue's count does not include messages
	// already expired and waiting to be dead-lettered.
	Messages int
	// Consumers should be 0: anything consuming a level queue takes
	// messages out of the cascade.
	Consumers int
	// DeadLettering is the level's dead-letter backlog: messages that
	// expired out of this level and that RabbitMQ's at-least-once
	// dead-letter worker has not yet handed to the next level (a quorum
	// queue's messages_dlx, "Quorum Queues", at-least-once
	// dead-lettering), read from the management API, which refreshes it
	// about every 5 s. Normally 0 or a few in transit; a lasting backlog
	// means the next hop had no route or refused them (a deleted level
	// queue or exchange, a length limit): they are still safe in this
	// queue and the worker retries them every
	// dead_letter_worker_publisher_confirm_timeout (3 min by default).
	// These messages are not in Messages: the cascade holds Messages +
	// DeadLettering. -1 when unknown: Config.ManagementURL not set, a
	// classic level (no buffer: it dead-letters at-most-once), or a queue
	// the management API has no statistics for yet (created seconds ago).
	DeadLettering int
	// LengthLimit lists the length limits in force on the level queue
	// ("max-length=100", "max-length-bytes=…", from a policy, an operator
	// policy or an argument; "Queue Length Limit"), read from the
	// management API; "" when none, or when Config.ManagementURL is not
	// set. Levels must have none: a full quorum level refuses publishes
	// (x-overflow reject-publish: the Delayer and Publisher hold the
	// message and publish it again, see Config.FullWait) and
	// dead-lettering into it (the messages wait in the level above for
	// the dead-letter worker's retry, minutes late).
	LengthLimit string
	// Full reports the level at its length limit: its count at or above
	// the max-length the management API shows, or (Publisher.Waiting)
	// it refused a publish of this Publisher
	// and has not shown room since (a publish accepted, or its ready
	// count below the count it had when it refused, read at each
	// TopologyCheck). A full level refuses scheduled messages (they are
	// held, see Config.FullWait) and dead-lettering from the level above
	// (that level's DeadLettering grows).
	Full bool
	// Refused counts the publishes this level refused (basic.nack) since
	// the Publisher started, held messages' retries included;
	// 0 from Config.Waiting.
	Refused int
}
