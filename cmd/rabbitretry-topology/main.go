// Command rabbitretry-topology shows and tidies the retry topology of one
// originating queue: the queue, its wait queues (one per delay tier), its
// poison queue, and the orphan wait queues an earlier deploy's tiers left
// behind. It reads the broker through the RabbitMQ management HTTP API
// ("Management Plugin") and deletes through AMQP; see
// amqpretry.Topology.Inspect and TidyOrphans.
//
// Usage:
//
//	rabbitretry-topology show|tidy --queue Q [flags]
//
// Commands:
//
//	show     print a table: queue, role, tier, messages, state (ok, missing, orphan)
//	tidy     delete the empty orphan wait queues; list the ones kept and why
//
// Flags (before or after the command):
//
//	--queue Q                 originating queue (required)
//	--uri URI                 AMQP URI (default $AMQP_URI, else amqp://guest:guest@localhost:5672/)
//	--management-url URL      management API base URL (default $RABBITMQ_MANAGEMENT_URL, else http://guest:guest@localhost:15672/)
//	--tiers 1s,2s,4s          the configured delay tiers (default: amqpretry.DefaultTiers of the library's default backoff and --max-attempts)
//	--max-attempts N          Config.MaxAttempts the default tiers derive from (default 5)
//	--queue-type T            classic (default) or quorum
//	--wait-exchange, --poison-exchange, --loopback-exchange   Naming, when not the defaults
//	--dry-run                 tidy: report what would be deleted, change nothing
//	--json                    show: print the report as JSON
//
// The tiers, queue type and names must be those the services use (their
// amqpretry.Config): a configured tier left out would show as an orphan,
// and tidy would delete it when empty (the services redeclare it when they
// reconnect or start).
//
// Exit status: 0 success (tidy: also when non-empty orphans were kept), 1
// operation failed (broker or management API unreachable, vhost unknown, a
// delete refused), 2 usage error. Passwords in --uri and --management-url
// are never printed.
package main

import "os"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}
