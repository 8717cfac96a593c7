// Command rabbitretry-topology shows and tidies the retry topology of one
// originating queue: the queue, its wait queues (one per delay tier), its
// poison queue, and the orphan wait queues an earlier deploy's tiers left
// behind. It reads the broker through the RabbitMQ management HTTP API
// ("Management Plugin") and deletes through AMQP; see
// amqpretry.Topology.Inspect and TidyOrphans. Its cascade commands show and
// manage the messages waiting in the delay cascade (package
// amqpretry/cascade), shared by every queue of a vhost, through AMQP only.
//
// Usage:
//
//	rabbitretry-topology show|tidy --queue Q [flags]
//	rabbitretry-topology cascade waiting|census|move|redirect|unredirect [flags]
//
// Commands:
//
//	show     print a table: queue, role, tier, messages, state (ok, missing, orphan)
//	tidy     delete the empty orphan wait queues; list the ones kept and why
//	cascade waiting   per level queue: TTL, messages, consumers (as cascade.Config.Waiting:
//	                  passive declares, fast, disturbs nothing); with --management-url also
//	                  each level's dead-letter backlog (messages expired out of it and not
//	                  yet in the next level) and any length limit on it
//	cascade census    per destination (messages, earliest and latest due time), then per
//	                  level and destination: every waiting message is taken
//	                  out and put back with its remaining delay (the copy's publish and the
//	                  original's ack in one transaction: interrupted, each message is put
//	                  back or left untouched)
//	cascade move      a census that puts the messages for --from back addressed to --to,
//	                  keeping their due times; --dry-run counts what would move
//	cascade redirect  bind --to with --from's key on the delivery exchange and unbind
//	                  --from: waiting and future messages for
//	                  --from arrive at --to, untouched; stop --from's services first, as
//	                  anything binding --from again makes its messages arrive at both
//	cascade unredirect  undo redirect: bind --from again, then
//	                  unbind --to's binding of --from's key
//
// Flags (before or after the command):
//
//	--queue Q                 originating queue (required)
//	--uri URI                 AMQP URI (default $AMQP_URI, else amqp://guest:guest@localhost:5672/)
//	--management-url URL      management API base URL (default $RABBITMQ_MANAGEMENT_URL, else http://guest:guest@localhost:15672/)
//	--tiers 1s,2s,4s          the configured delay tiers (default: amqpretry.DefaultTiers of the library's default backoff and --max-attempts)
//	--max-attempts N          Config.MaxAttempts the default tiers derive from (default 5)
//	--queue-type T            classic or quorum (default classic; cascade: quorum)
//	--wait-exchange, --poison-exchange, --loopback-exchange   Naming, when not the defaults
//	--dry-run                 tidy: report what would be deleted, change nothing;
//	                          cascade move: count what would move, move nothing
//	--json                    show, cascade census: print the report as JSON
//	--cascade-prefix P        cascade: the cascade's name prefix (default rabbitretry.delay)
//	--grain D                 cascade: its grain (default 100ms)
//	--levels N                cascade: its levels (default derived from --grain: 26 for 100ms)
//	--from Q, --to Q2         cascade move, redirect, unredirect: old and new destination queue
//	--level N,...             cascade census, move: only these levels (default all)
//
// The tiers, queue type and names must be those the services use (their
// amqpretry.Config): a configured tier left out would show as an orphan,
// and tidy would delete it when empty (the services redeclare it when they
// reconnect or start). Likewise the cascade flags must be the services'
// cascade.Config (a census with other --levels finds keys it cannot read:
// it puts those messages back unchanged and counts them as foreign).
//
// Exit status: 0 success (tidy: also when non-empty orphans were kept), 1
// operation failed (broker or management API unreachable, vhost unknown, a
// delete refused), 2 usage error. Passwords in --uri and --management-url
// are never printed.
//
// # Imports
//
// A binary: it may import any library package of this module and internal/...;
// nothing imports it (TestLayers in docs/).
package main
