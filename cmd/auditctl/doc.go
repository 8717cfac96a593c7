// Command auditctl searches rabbitretry's message audit (package audit,
// stored in PostgreSQL by audit/pgstore), shows one message's story,
// resends messages from their recorded arrival, prunes old records and
// serves the read-only HTTP JSON API (package audit/httpapi).
//
// Usage:
//
//	auditctl [global flags] <command> [flags] [args]
//
// Commands:
//
//	migrate          create or upgrade the audit schema
//	search           list matching messages (table, or JSON with --json)
//	show <id>        one message: arrival (headers, body) and attempts
//	resend           publish matching messages again: --to-queue or --to-exchange
//	prune            delete records older than --older-than
//	stats            record counts and time range
//	serve            the HTTP JSON API (read-only unless --enable-resend)
//
// Global flags (before or after the command):
//
//	--dsn DSN        PostgreSQL (default $RABBITRETRY_PG_DSN, else
//	                 postgres://postgres@127.0.0.1:5432/test?sslmode=disable)
//	--schema NAME    audit schema (default rabbitretry_audit)
//	--uri URI        AMQP URI for resend (default $AMQP_URI, else
//	                 amqp://guest:guest@localhost:5672/)
//	--json           machine-readable JSON on stdout
//
// Filter flags (search, resend): --message-id, --correlation-id, --from,
// --to (RFC 3339, or a duration ago: 1h or -1h), --queue, --exchange,
// --routing-key, --outcome, --last-outcome, --class, --error-contains,
// --header key=value (repeatable; value parsed as JSON when it is JSON,
// else a string), --limit, --after (the cursor search prints for the next
// page).
//
// Resend: exactly one of --to-queue (to the original queue only, through
// the loop-back exchange; --target-queue Q to name it) and --to-exchange
// (the original exchange and routing key: every bound queue gets it
// again). --dry-run shows what would be sent. A real resend of more than
// one message needs --yes; a filter selecting everything needs --all.
// --to-exchange first reads the exchange's bindings from the management
// HTTP API (--management-url, default $RABBITMQ_MANAGEMENT_URL, else the
// --uri host and user on port 15672): a message only the audit's own
// arrivals queue would receive is reported failed and not published.
//
// Serve: --listen ADDR (default 127.0.0.1:8080). Read-only unless
// --enable-resend, which needs the bearer token (16+ bytes) in
// $RABBITRETRY_AUDIT_RESEND_TOKEN; with $RABBITRETRY_AUDIT_READ_TOKEN set,
// the GET routes need it too (tokens travel in the environment, never on
// the command line, which ps shows). Server timeouts: 5 s to read a
// request's headers, 30 s to read a request, 5 min 30 s to write a
// response (a resend is bounded by 5 min), 2 min idle keep-alive; on
// SIGINT/SIGTERM requests in flight get up to 5 min to finish.
//
// Exit status: 0 success, 1 operation failed (database or broker
// unreachable, message not found, a matched message not resent), 2 usage
// error.
//
// # Imports
//
// A binary: it may import any library package of this module and internal/...;
// nothing imports it (TestLayers in docs/).
package main
