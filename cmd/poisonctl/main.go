// Command poisonctl inspects and repairs RabbitMQ poison queues written by
// rabbitretry's middleware.PoisonForwarder: list, show, replay, move, purge and
// summarise poisoned messages. It is a thin front end to package
// github.com/rabbitretry/rabbitretry/poison/admin; see that package for how
// queues are read (every read requeues the messages it does not remove).
//
// Usage:
//
//	poisonctl [global flags] <command> [flags] [args]
//
// Commands:
//
//	list            list matching messages (table, or JSON with --json)
//	show <uuid>     show one message with all headers and its body
//	replay          send matching messages back to their original queue
//	move --to Q     move matching messages to queue Q
//	purge           delete matching messages (needs --yes or --dry-run)
//	stats           count messages by class, handler and original queue
//
// Global flags (accepted before or after the command):
//
//	--uri URI       AMQP URI (default $AMQP_URI, else amqp://guest:guest@localhost:5672/)
//	--queue NAME    poison queue to operate on (required)
//	--json          machine-readable JSON on stdout
//
// Filter flags (list, show, replay, move, purge): --reason SUBSTR,
// --reason-regexp RE, --handler NAME, --class CLASS, --original-queue Q,
// --since T, --until T (RFC 3339, since inclusive, until exclusive),
// --header k=v (repeatable, all must match), --uuid U (repeatable, any
// matches), --limit N (0 = all).
//
// Exit status: 0 success, 1 operation failed (broker unreachable, queue
// missing, a message could not be replayed, a replay left matching messages
// in the poison queue, an operation stopped because its connection
// closed...), 2 usage error. An interrupted replay prints how many messages
// were replayed and how many are left, and names the one message, if any,
// that may now be in both queues.
package main

import "os"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}
