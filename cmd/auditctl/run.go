package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/auditparse"
	"github.com/rabbitretry/rabbitretry/internal/cliflags"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1 // the operation failed
	exitUsage = 2 // bad command line
)

const (
	defaultDSN    = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultURI    = "amqp://guest:guest@localhost:5672/"
	defaultListen = "127.0.0.1:8080"
	// tokenEnv holds the bearer token of serve --enable-resend (an
	// environment variable, not a flag: flags show in ps).
	tokenEnv = "RABBITRETRY_AUDIT_RESEND_TOKEN"
	// readTokenEnv, when set, is the bearer token the GET routes of serve
	// require (httpapi.Config.ReadToken).
	readTokenEnv = "RABBITRETRY_AUDIT_READ_TOKEN"
	// mgmtEnv is the default --management-url (as rabbitretry-topology's).
	mgmtEnv    = "RABBITMQ_MANAGEMENT_URL"
	errorWidth = 60
	// bodyPreview is how much of a body show prints.
	bodyPreview = 2048
	// maxResultLines bounds the per-message lines resend prints.
	maxResultLines = 50
)

// HTTP server timeouts of serve.
const (
	// serveReadHeaderTimeout bounds reading a request's headers (slowloris).
	serveReadHeaderTimeout = 5 * time.Second
	// serveReadTimeout bounds reading a whole request (bodies are <= 1 MiB).
	serveReadTimeout = 30 * time.Second
	// serveWriteTimeout bounds a response: a resend's own bound
	// (auditconst.ResendTimeout) plus a margin.
	serveWriteTimeout = auditconst.ResendTimeout + 30*time.Second
	// serveIdleTimeout closes idle keep-alive connections.
	serveIdleTimeout = 2 * time.Minute
	// serveShutdownTimeout is how long serve waits for requests in flight
	// (a resend included) after SIGINT/SIGTERM.
	serveShutdownTimeout = auditconst.ResendTimeout
)

// run is the whole program minus os.Exit. SIGINT and SIGTERM cancel the
// operation (serve shuts down gracefully).
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return runContext(ctx, args, stdout, stderr)
}

// options holds every flag of every command.
type options struct {
	dsn, schema, uri string
	json             bool

	messageID, correlationID, from, to         string
	queue, exchange, routingKey                string
	outcome, lastOutcome, class, errorContains string
	headers                                    multiFlag
	limit                                      int
	after                                      string

	toQueue, toExchange, dryRun, yes, all bool
	targetQueue, loopBack                 string
	mgmtURL                               string

	olderThan time.Duration
	batch     int

	listen       string
	enableResend bool
}

// multiFlag is a repeatable string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// env is what a command runs with.
type env struct {
	ctx            context.Context
	o              *options
	f              audit.Filter
	pos            []string
	stdout, stderr io.Writer
	now            time.Time
}

type command struct {
	summary string
	args    string
	nargs   int
	filter  bool
	flags   func(fs *flag.FlagSet, o *options)
	check   func(o *options) string // a usage error, or ""
	run     func(e *env) int
}

// sub is what the parser needs of c.
func (c *command) sub() cliflags.Sub[*options] {
	return cliflags.Sub[*options]{Summary: c.summary, Args: c.args, NArgs: c.nargs, Filter: c.filter, Flags: c.flags}
}

var commands map[string]*command

var commandOrder = []string{"migrate", "search", "show", "resend", "prune", "stats", "serve"}

func init() {
	commands = map[string]*command{
		"migrate": {summary: "create or upgrade the audit schema", run: cmdMigrate},
		"search":  {summary: "list matching messages, newest first", filter: true, run: cmdSearch},
		"show":    {summary: "show one message: its arrival (headers, body) and its attempts", args: "<message-id>", nargs: 1, run: cmdShow},
		"resend": {summary: "publish matching messages again (--to-queue or --to-exchange)", filter: true,
			flags: func(fs *flag.FlagSet, o *options) {
				fs.BoolVar(&o.toQueue, "to-queue", false, "send to the original queue only (through the loop-back exchange)")
				fs.BoolVar(&o.toExchange, "to-exchange", false, "send to the original exchange and routing key: EVERY bound queue gets it again")
				fs.StringVar(&o.targetQueue, "target-queue", "", "with --to-queue: send to this `queue` (default: --queue, else the queue the message's attempts were made in)")
				fs.StringVar(&o.loopBack, "loop-back-exchange", auditconst.LoopBackExchange, "loop-back `exchange` of the retry topology")
				fs.StringVar(&o.mgmtURL, "management-url", "", "management HTTP API `URL` a --to-exchange resend reads the exchange's bindings from (default $"+mgmtEnv+", else the --uri host and user on port 15672)")
				fs.BoolVar(&o.dryRun, "dry-run", false, "report what would be sent; send nothing")
				fs.BoolVar(&o.yes, "yes", false, "confirm a resend of more than one message")
				fs.BoolVar(&o.all, "all", false, "allow a filter that selects every message")
			},
			check: func(o *options) string {
				switch {
				case o.toQueue == o.toExchange:
					return "resend: exactly one of --to-queue and --to-exchange is required"
				case o.targetQueue != "" && !o.toQueue:
					return "resend: --target-queue is only for --to-queue"
				case o.limit > auditconst.MaxResendLimit:
					return fmt.Sprintf("resend: --limit at most %d", auditconst.MaxResendLimit)
				}
				return ""
			},
			run: cmdResend},
		"prune": {summary: "delete audit records older than --older-than", flags: func(fs *flag.FlagSet, o *options) {
			fs.DurationVar(&o.olderThan, "older-than", 0, "delete records older than this `duration` (e.g. 720h; required)")
			fs.IntVar(&o.batch, "batch", auditconst.PruneBatch, "rows per DELETE `n` (each its own short transaction)")
		}, check: func(o *options) string {
			switch {
			case o.olderThan <= 0:
				return "prune: --older-than is required and must be positive (e.g. 720h)"
			case o.batch <= 0:
				return "prune: --batch must be positive"
			}
			return ""
		}, run: cmdPrune},
		"stats": {summary: "count records and show their time range", run: cmdStats},
		"serve": {summary: "serve the HTTP JSON API (read-only unless --enable-resend)", flags: func(fs *flag.FlagSet, o *options) {
			fs.StringVar(&o.listen, "listen", defaultListen, "`address` to listen on")
			fs.BoolVar(&o.enableResend, "enable-resend", false, "enable POST /v1/resend; needs the bearer token in $"+tokenEnv+" (16+ bytes)")
			fs.StringVar(&o.loopBack, "loop-back-exchange", auditconst.LoopBackExchange, "loop-back `exchange` of the retry topology (resend)")
			fs.StringVar(&o.mgmtURL, "management-url", "", "management HTTP API `URL` a to-exchange resend reads the exchange's bindings from (default $"+mgmtEnv+", else the --uri host and user on port 15672)")
		}, check: func(o *options) string {
			if o.enableResend && len(os.Getenv(tokenEnv)) < 16 {
				return "serve: --enable-resend needs a bearer token of at least 16 bytes in $" + tokenEnv
			}
			if rt := os.Getenv(readTokenEnv); rt != "" && len(rt) < 16 {
				return "serve: $" + readTokenEnv + " must be at least 16 bytes"
			}
			return ""
		}, run: cmdServe},
	}
}

func (o *options) globalFlags(fs *flag.FlagSet) {
	// Defaults are the current values, so flags given before the command
	// survive the command's flag set.
	fs.StringVar(&o.dsn, "dsn", o.dsn, "PostgreSQL `DSN` (default $RABBITRETRY_PG_DSN, else "+defaultDSN+")")
	fs.Lookup("dsn").DefValue = ""
	fs.StringVar(&o.schema, "schema", o.schema, "audit `schema` (default "+auditconst.Schema+")")
	fs.StringVar(&o.uri, "uri", o.uri, "AMQP `URI` for resend (default $AMQP_URI, else "+defaultURI+")")
	fs.Lookup("uri").DefValue = "" // never print a password in the usage
	fs.BoolVar(&o.json, "json", o.json, "print JSON on stdout")
}

func (o *options) filterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.messageID, "message-id", "", "match the message `id` (Watermill UUID)")
	fs.StringVar(&o.correlationID, "correlation-id", "", "match the correlation `id`")
	fs.StringVar(&o.from, "from", "", "messages at or after `time` (RFC 3339, or a duration ago: 1h, -1h)")
	fs.StringVar(&o.to, "to", "", "messages before `time` (RFC 3339, or a duration ago)")
	fs.StringVar(&o.queue, "queue", "", "match an attempt's `queue`")
	fs.StringVar(&o.exchange, "exchange", "", "match the arrival's `exchange`")
	fs.StringVar(&o.routingKey, "routing-key", "", "match the arrival's routing `key`")
	fs.StringVar(&o.outcome, "outcome", "", "match any attempt's `outcome` (success, retry, poisoned, dropped, nacked, requeued)")
	fs.StringVar(&o.lastOutcome, "last-outcome", "", "match the latest attempt's `outcome`")
	fs.StringVar(&o.class, "class", "", "match an attempt's error `class` (transient, permanent, malformed, exhausted, ...)")
	fs.StringVar(&o.errorContains, "error-contains", "", "match attempts whose error contains `text` (case-insensitive)")
	fs.Var(&o.headers, "header", "match arrival header `key=value` (repeatable; value is JSON if it parses, else a string)")
	fs.IntVar(&o.limit, "limit", 0, "at most `n` messages (search: default 100, max 10000; resend: default 1000)")
	fs.StringVar(&o.after, "after", "", "continue after this `cursor` (printed by the previous page)")
}

func printUsage(w io.Writer) {
	fmt.Fprintf(w, `Usage: auditctl [--dsn DSN] [--schema S] [--uri URI] [--json] <command> [flags] [args]

Search, show, resend and prune rabbitretry's message audit (PostgreSQL).

Commands:
`)
	for _, name := range commandOrder {
		c := commands[name]
		fmt.Fprintf(w, "  %-18s %s\n", strings.TrimSpace(name+" "+c.args), c.summary)
	}
	fmt.Fprintf(w, `
Run "auditctl <command> -h" for the flags of a command.
Exit status: 0 ok, 1 operation failed, 2 usage error.
`)
}

func usageErr(stderr io.Writer, format string, args ...any) int {
	return cliflags.Tool{Name: "auditctl"}.UsageError(stderr, format, args...)
}

func fail(stderr io.Writer, err error) int {
	fmt.Fprintf(stderr, "auditctl: %v\n", err)
	return exitFail
}

func runContext(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	// Every message, usage error and log line goes through stderr: no
	// password of --uri / --dsn / $AMQP_URI / $RABBITRETRY_PG_DSN in it.
	stderr = redact.Writer(stderr, redact.CommandLine(args, "AMQP_URI", "RABBITRETRY_PG_DSN")...)
	o := &options{}
	name, pos, code, ok := cliflags.Tool{
		Name: "auditctl", Order: commandOrder, Global: o.globalFlags, PrintUsage: printUsage,
		Lookup: cliflags.Lookup(commands, (*command).sub, o, o.filterFlags),
	}.Parse(args, stderr)
	if !ok {
		return code
	}
	cmd := commands[name]
	now := time.Now()
	var f audit.Filter
	if cmd.filter {
		var err error
		if f, err = o.filter(now, name); err != nil {
			return usageErr(stderr, "%s: %v", name, err)
		}
	}
	if cmd.check != nil {
		if msg := cmd.check(o); msg != "" {
			return usageErr(stderr, "%s", msg)
		}
	}
	if o.dsn == "" {
		o.dsn = os.Getenv("RABBITRETRY_PG_DSN")
	}
	if o.dsn == "" {
		o.dsn = defaultDSN
	}
	if o.schema == "" {
		o.schema = auditconst.Schema
	}
	if o.uri == "" {
		o.uri = os.Getenv("AMQP_URI")
	}
	if o.uri == "" {
		o.uri = defaultURI
	}
	if o.mgmtURL == "" {
		o.mgmtURL = os.Getenv(mgmtEnv)
	}
	return cmd.run(&env{ctx: ctx, o: o, f: f, pos: pos, stdout: stdout, stderr: stderr, now: now})
}

// filter builds the audit.Filter from the filter flags; errors are usage
// errors.
func (o *options) filter(now time.Time, cmd string) (audit.Filter, error) {
	f := audit.Filter{
		MessageID: o.messageID, CorrelationID: o.correlationID,
		Queue: o.queue, Exchange: o.exchange, RoutingKey: o.routingKey,
		ErrorClass: o.class, ErrorContains: o.errorContains, After: o.after,
	}
	var err error
	if f.From, err = parseWhen("from", o.from, now); err != nil {
		return f, err
	}
	if f.To, err = parseWhen("to", o.to, now); err != nil {
		return f, err
	}
	if !f.From.IsZero() && !f.To.IsZero() && !f.From.Before(f.To) {
		return f, errors.New("--from must be before --to")
	}
	if f.Outcome, err = auditparse.Outcome(o.outcome); err != nil {
		return f, fmt.Errorf("--%v", err)
	}
	if f.LastOutcome, err = auditparse.Outcome(o.lastOutcome); err != nil {
		return f, fmt.Errorf("--last-%v", err)
	}
	for _, kv := range o.headers {
		k, v, err := auditparse.HeaderMatch(kv)
		if err != nil {
			return f, fmt.Errorf("--%v", err)
		}
		if f.Headers == nil {
			f.Headers = map[string]any{}
		}
		f.Headers[k] = v
	}
	if o.limit < 0 {
		return f, fmt.Errorf("--limit must be >= 0, got %d", o.limit)
	}
	if cmd == "search" {
		if o.limit > auditconst.MaxSearchLimit {
			return f, fmt.Errorf("--limit at most %d", auditconst.MaxSearchLimit)
		}
		f.Limit = o.limit
	}
	return f, nil
}

// parseWhen accepts RFC 3339 or a duration meaning "that long ago" (1h and
// -1h alike).
func parseWhen(name, s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d != 0 {
		return now.Add(-d.Abs()), nil
	}
	return time.Time{}, fmt.Errorf("--%s %q: want an RFC 3339 time (2026-11-24T09:00:00Z) or a duration ago (1h, -1h)", name, s)
}

// openStore opens the audit store without migrating: a missing schema is
// an error that says to run migrate.
func openStore(e *env) (*pgstore.Store, error) {
	st, err := pgstore.New(e.ctx, pgstore.Config{DSN: e.o.dsn, Schema: e.o.schema, SkipMigrate: true, ConnectTimeout: 15 * time.Second})
	if err != nil {
		if strings.Contains(err.Error(), "is at migration") {
			return nil, fmt.Errorf("%w (run: auditctl migrate)", err)
		}
		return nil, err
	}
	return st, nil
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func jsonOut(e *env, v any, code int) int {
	if err := writeJSON(e.stdout, v); err != nil {
		return fail(e.stderr, fmt.Errorf("writing output: %w", err))
	}
	return code
}
