package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/httpapi"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
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
	// (httpapi.DefaultResendTimeout) plus a margin.
	serveWriteTimeout = httpapi.DefaultResendTimeout + 30*time.Second
	// serveIdleTimeout closes idle keep-alive connections.
	serveIdleTimeout = 2 * time.Minute
	// serveShutdownTimeout is how long serve waits for requests in flight
	// (a resend included) after SIGINT/SIGTERM.
	serveShutdownTimeout = httpapi.DefaultResendTimeout
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
				fs.StringVar(&o.loopBack, "loop-back-exchange", audit.DefaultLoopBackExchange, "loop-back `exchange` of the retry topology")
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
				case o.limit > audit.MaxResendLimit:
					return fmt.Sprintf("resend: --limit at most %d", audit.MaxResendLimit)
				}
				return ""
			},
			run: cmdResend},
		"prune": {summary: "delete audit records older than --older-than", flags: func(fs *flag.FlagSet, o *options) {
			fs.DurationVar(&o.olderThan, "older-than", 0, "delete records older than this `duration` (e.g. 720h; required)")
			fs.IntVar(&o.batch, "batch", pgstore.DefaultPruneBatch, "rows per DELETE `n` (each its own short transaction)")
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
			fs.StringVar(&o.loopBack, "loop-back-exchange", audit.DefaultLoopBackExchange, "loop-back `exchange` of the retry topology (resend)")
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
	fs.StringVar(&o.schema, "schema", o.schema, "audit `schema` (default "+pgstore.DefaultSchema+")")
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
		Lookup: func(name string) (cliflags.Command, bool) {
			cmd, found := commands[name]
			if !found {
				return cliflags.Command{}, false
			}
			return cliflags.Command{Summary: cmd.summary, Args: cmd.args, NArgs: cmd.nargs, Flags: func(fs *flag.FlagSet) {
				if cmd.filter {
					o.filterFlags(fs)
				}
				if cmd.flags != nil {
					cmd.flags(fs, o)
				}
			}}, true
		},
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
		o.schema = pgstore.DefaultSchema
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
	if f.Outcome, err = httpapi.ParseOutcome(o.outcome); err != nil {
		return f, fmt.Errorf("--%v", err)
	}
	if f.LastOutcome, err = httpapi.ParseOutcome(o.lastOutcome); err != nil {
		return f, fmt.Errorf("--last-%v", err)
	}
	for _, kv := range o.headers {
		k, v, err := httpapi.ParseHeaderMatch(kv)
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
		if o.limit > pgstore.MaxLimit {
			return f, fmt.Errorf("--limit at most %d", pgstore.MaxLimit)
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

// oneLine replaces control characters by spaces so a value fits a cell.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
}

func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-3]) + "..."
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02T15:04:05.000Z07:00")
}

func cmdMigrate(e *env) int {
	ctx, cancel := context.WithTimeout(e.ctx, 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, e.o.dsn)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer pool.Close()
	applied, err := pgstore.Migrate(ctx, pool, e.o.schema)
	if err != nil {
		return fail(e.stderr, err)
	}
	v, err := pgstore.SchemaVersion(ctx, pool, e.o.schema)
	if err != nil {
		return fail(e.stderr, err)
	}
	if applied == nil {
		applied = []int{}
	}
	if e.o.json {
		return jsonOut(e, map[string]any{"schema": e.o.schema, "applied": applied, "version": v}, exitOK)
	}
	if len(applied) == 0 {
		fmt.Fprintf(e.stdout, "schema %s is up to date (migration %d)\n", e.o.schema, v)
	} else {
		fmt.Fprintf(e.stdout, "schema %s: applied migration(s) %v, now at %d\n", e.o.schema, applied, v)
	}
	return exitOK
}

// messageTime is the time Search sorts by.
func messageTime(m audit.Message) time.Time {
	if m.Arrival != nil {
		return m.Arrival.ArrivedAt
	}
	var t time.Time
	for _, a := range m.Attempts {
		if t.IsZero() || a.StartedAt.Before(t) {
			t = a.StartedAt
		}
	}
	return t
}

func lastAttempt(m audit.Message) *audit.Attempt {
	var best *audit.Attempt
	for i := range m.Attempts {
		a := &m.Attempts[i]
		if best == nil || a.Attempt > best.Attempt || (a.Attempt == best.Attempt && a.StartedAt.After(best.StartedAt)) {
			best = a
		}
	}
	return best
}

func cmdSearch(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	// Listings carry no bodies (show has them): SearchEach reads none.
	msgs := []audit.Message{}
	next, err := st.SearchEach(e.ctx, e.f, func(m audit.Message) error {
		msgs = append(msgs, m)
		return nil
	})
	if err != nil {
		return fail(e.stderr, err)
	}
	if e.o.json {
		return jsonOut(e, httpapi.SearchResponse{Messages: msgs, Next: next}, exitOK)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TIME\tMESSAGE ID\tEXCHANGE\tROUTING KEY\tQUEUE\tATTEMPTS\tLAST OUTCOME\tCLASS\tERROR")
	for _, m := range msgs {
		ex, key := "-", "-"
		if m.Arrival != nil {
			ex, key = orDash(oneLine(m.Arrival.Exchange)), orDash(oneLine(m.Arrival.RoutingKey))
		}
		q, outcome, class, errText := "-", "-", "-", ""
		if a := lastAttempt(m); a != nil {
			q, outcome, class, errText = orDash(oneLine(a.Queue)), string(a.Outcome), orDash(oneLine(a.ErrorClass)), a.Error
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", formatTime(messageTime(m)), orDash(oneLine(m.MessageID)),
			ex, key, q, len(m.Attempts), outcome, class, truncate(oneLine(errText), errorWidth))
	}
	if err := tw.Flush(); err != nil {
		return fail(e.stderr, fmt.Errorf("writing output: %w", err))
	}
	fmt.Fprintf(e.stderr, "%d message(s)\n", len(msgs))
	if next != "" {
		fmt.Fprintf(e.stderr, "more: add --after %s\n", next)
	}
	return exitOK
}

func cmdShow(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	id := e.pos[0]
	m, ok, err := st.Get(e.ctx, id)
	if err != nil {
		return fail(e.stderr, err)
	}
	if !ok {
		fmt.Fprintf(e.stderr, "auditctl: no audit record of message %q\n", id)
		return exitFail
	}
	if e.o.json {
		return jsonOut(e, m, exitOK)
	}
	w := e.stdout
	fmt.Fprintf(w, "Message %s\n", m.MessageID)
	if a := m.Arrival; a == nil {
		fmt.Fprintln(w, "\nArrival: none recorded (published before auditing began, or not through an audited exchange): cannot be resent")
	} else {
		fmt.Fprintln(w, "\nArrival:")
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		for _, row := range [][2]string{
			{"Exchange", a.Exchange}, {"Routing key", a.RoutingKey},
			{"Correlation id", a.CorrelationID},
			{"Published at", formatTime(a.PublishedAt)}, {"Arrived at", formatTime(a.ArrivedAt)},
			{"Record id", a.ID},
		} {
			fmt.Fprintf(tw, "  %s:\t%s\n", row[0], oneLine(orDash(row[1])))
		}
		for _, k := range sortedKeys(a.Properties) {
			fmt.Fprintf(tw, "  %s:\t%s\n", k, oneLine(a.Properties[k]))
		}
		_ = tw.Flush()
		if len(a.Headers) > 0 {
			fmt.Fprintln(w, "  Headers:")
			tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
			for _, k := range sortedKeys(a.Headers) {
				b, _ := json.Marshal(a.Headers[k])
				fmt.Fprintf(tw, "    %s:\t%s\n", oneLine(k), truncate(oneLine(string(b)), 200))
			}
			_ = tw.Flush()
		}
		body, note := a.Body, ""
		if a.BodyTruncated {
			note = fmt.Sprintf(", TRUNCATED in the audit: %d of %d bytes stored", len(a.Body), a.BodySize)
		}
		if len(body) > bodyPreview {
			body, note = body[:bodyPreview], note+fmt.Sprintf(", first %d shown", bodyPreview)
		}
		if utf8.Valid(body) {
			fmt.Fprintf(w, "  Body (%d bytes%s):\n%s\n", a.BodySize, note, body)
		} else {
			fmt.Fprintf(w, "  Body (%d bytes, binary, base64%s):\n%s\n", a.BodySize, note, base64.StdEncoding.EncodeToString(body))
		}
	}
	fmt.Fprintf(w, "\nAttempts (%d):\n", len(m.Attempts))
	if len(m.Attempts) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  #\tSTARTED\tQUEUE\tDURATION\tOUTCOME\tDELAY\tCLASS\tERROR")
		for _, a := range m.Attempts {
			delay := "-"
			if a.Delay > 0 {
				delay = a.Delay.String()
			}
			fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", a.Attempt, formatTime(a.StartedAt), orDash(oneLine(a.Queue)),
				a.Duration, a.Outcome, delay, orDash(oneLine(a.ErrorClass)), truncate(oneLine(a.Error), 200))
		}
		_ = tw.Flush()
	}
	return exitOK
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func cmdResend(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	r, err := audit.NewResender(audit.ResenderConfig{URI: e.o.uri, Store: st, LoopBackExchange: e.o.loopBack, ManagementURL: e.o.mgmtURL})
	if err != nil {
		return fail(e.stderr, err)
	}
	defer r.Close()
	opts := audit.ResendOptions{Mode: audit.ResendToExchange, DryRun: e.o.dryRun, Limit: e.o.limit, AllowAll: e.o.all}
	if e.o.toQueue {
		opts.Mode, opts.Queue = audit.ResendToQueue, e.o.targetQueue
	}
	f := e.f
	if !e.o.dryRun {
		// See first. Without --yes, go ahead only for a single message,
		// narrowed to that message so a newer match cannot slip in. With
		// --yes, send what the dry run saw: AllowAll (breadth, judged by
		// the result, is confirmed) and the dry run's count as
		// ExpectedCount (a changed result stops before sending).
		dry := opts
		dry.DryRun = true
		rep, err := r.Resend(e.ctx, f, dry)
		if err != nil {
			return resendFailed(e, rep, err)
		}
		if e.o.yes {
			opts.AllowAll, opts.ExpectedCount = true, rep.Matched
			if rep.Matched == 0 {
				return reportResend(e, rep, nil)
			}
			rep, err = r.Resend(e.ctx, f, opts)
			return reportResend(e, rep, err)
		}
		var ids []string
		for _, res := range rep.Results {
			if res.Status == audit.StatusWouldSend {
				ids = append(ids, res.MessageID)
			}
		}
		if len(ids) > 1 || rep.Next != "" {
			printReport(e, rep)
			return usageErr(e.stderr, "resend: %d messages would be sent (above); pass --yes to send them, or narrow the filter", len(ids))
		}
		if len(ids) == 0 {
			return reportResend(e, rep, nil)
		}
		f.MessageID = ids[0]
	}
	rep, err := r.Resend(e.ctx, f, opts)
	return reportResend(e, rep, err)
}

func resendFailed(e *env, rep audit.ResendReport, err error) int {
	if errors.Is(err, audit.ErrEmptyFilter) {
		return usageErr(e.stderr, "resend: the filter selects every message: narrow it, or pass --all")
	}
	return reportResend(e, rep, err)
}

type resendJSON struct {
	audit.ResendReport
	Error string `json:"error,omitempty"`
}

// reportResend prints the report; exit 1 if Resend failed or a matched
// message was not (or, in a dry run, would not be) sent.
func reportResend(e *env, rep audit.ResendReport, err error) int {
	if errors.Is(err, audit.ErrEmptyFilter) {
		return usageErr(e.stderr, "resend: the filter selects every message: narrow it, or pass --all")
	}
	code := exitOK
	if err != nil || rep.Failed > 0 || rep.Skipped > 0 || rep.Unsent > 0 {
		code = exitFail
	}
	if e.o.json {
		out := resendJSON{ResendReport: rep}
		if err != nil {
			out.Error = err.Error()
		}
		return jsonOut(e, out, code)
	}
	printReport(e, rep)
	if err != nil {
		fmt.Fprintf(e.stderr, "auditctl: %v\n", err)
	}
	return code
}

func printReport(e *env, rep audit.ResendReport) {
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MESSAGE ID\tSTATUS\tEXCHANGE\tROUTING KEY\tERROR")
	for i, res := range rep.Results {
		if i == maxResultLines {
			fmt.Fprintf(tw, "... %d more\t\t\t\t\n", len(rep.Results)-i)
			break
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", orDash(oneLine(res.MessageID)), res.Status, orDash(oneLine(res.Exchange)),
			orDash(oneLine(res.RoutingKey)), oneLine(res.Error))
	}
	_ = tw.Flush()
	verb := "sent"
	if rep.DryRun {
		verb = "would send"
	}
	fmt.Fprintf(e.stderr, "%s: matched %d, %s %d, failed %d, skipped %d", rep.Mode, rep.Matched, verb, rep.Sent, rep.Failed, rep.Skipped)
	if rep.Unsent > 0 {
		fmt.Fprintf(e.stderr, ", unsent (stopped) %d", rep.Unsent)
	}
	fmt.Fprintln(e.stderr)
	if rep.Next != "" {
		fmt.Fprintf(e.stderr, "more matched than --limit: continue with --after %s\n", rep.Next)
	}
}

func cmdPrune(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	before := e.now.Add(-e.o.olderThan)
	start := time.Now()
	res, err := st.PruneDetail(e.ctx, before, e.o.batch)
	if err != nil {
		fmt.Fprintf(e.stderr, "deleted before the error: %d arrivals, %d attempts\n", res.Arrivals, res.Attempts)
		return fail(e.stderr, err)
	}
	if e.o.json {
		return jsonOut(e, map[string]any{"older_than": before.UTC(), "arrivals": res.Arrivals, "attempts": res.Attempts,
			"messages": res.Messages, "statements": res.Statements, "seconds": time.Since(start).Seconds()}, exitOK)
	}
	fmt.Fprintf(e.stdout, "pruned records before %s: %d arrivals, %d attempts, %d messages (%d statements, %v)\n",
		formatTime(before), res.Arrivals, res.Attempts, res.Messages, res.Statements, time.Since(start).Round(time.Millisecond))
	return exitOK
}

// statsJSON is pgstore.Stats with snake_case names (auditctl stats --json,
// GET /v1/stats).
type statsJSON struct {
	Schema        string    `json:"schema"`
	SchemaVersion int       `json:"schema_version"`
	Arrivals      int64     `json:"arrivals"`
	Attempts      int64     `json:"attempts"`
	Messages      int64     `json:"messages"`
	OldestArrival time.Time `json:"oldest_arrival,omitzero"`
	NewestArrival time.Time `json:"newest_arrival,omitzero"`
	OldestAttempt time.Time `json:"oldest_attempt,omitzero"`
	NewestAttempt time.Time `json:"newest_attempt,omitzero"`
	TrigramIndex  bool      `json:"trigram_index"`
	// SetAside counts the records the store rejected for good, kept
	// apart with their reasons; SetAsideRecent are the latest 10.
	SetAside       int64                     `json:"set_aside"`
	SetAsideRecent []pgstore.SetAsideSummary `json:"set_aside_recent,omitempty"`
}

func stats(ctx context.Context, st *pgstore.Store) (statsJSON, error) {
	s, err := st.Stats(ctx)
	return statsJSON{Schema: st.Schema(), SchemaVersion: s.SchemaVersion, Arrivals: s.Arrivals, Attempts: s.Attempts,
		Messages: s.Messages, OldestArrival: s.OldestArrival, NewestArrival: s.NewestArrival,
		OldestAttempt: s.OldestAttempt, NewestAttempt: s.NewestAttempt, TrigramIndex: s.TrigramIndex,
		SetAside: s.SetAside, SetAsideRecent: s.SetAsideRecent}, err
}

func cmdStats(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	s, err := stats(e.ctx, st)
	if err != nil {
		return fail(e.stderr, err)
	}
	if e.o.json {
		return jsonOut(e, s, exitOK)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	for _, row := range [][2]string{
		{"Schema", fmt.Sprintf("%s (migration %d)", s.Schema, s.SchemaVersion)},
		{"Messages", fmt.Sprint(s.Messages)},
		{"Arrivals", fmt.Sprintf("%d (%s .. %s)", s.Arrivals, formatTime(s.OldestArrival), formatTime(s.NewestArrival))},
		{"Attempts", fmt.Sprintf("%d (%s .. %s)", s.Attempts, formatTime(s.OldestAttempt), formatTime(s.NewestAttempt))},
		{"Error text index", map[bool]string{true: "pg_trgm", false: "none (error-contains scans)"}[s.TrigramIndex]},
		{"Set aside", fmt.Sprintf("%d (records the store rejects for good; table set_aside)", s.SetAside)},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", row[0], row[1])
	}
	for _, r := range s.SetAsideRecent {
		fmt.Fprintf(tw, "  %s\t%s %s message %q: %s\n", formatTime(r.At), r.Kind, truncate(r.RecordID, 64), truncate(r.MessageID, 64), r.Reason)
	}
	_ = tw.Flush()
	return exitOK
}

func cmdServe(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	logger := watermill.NewStdLoggerWithOut(e.stderr, false, false)
	cfg := httpapi.Config{
		Store:     st,
		Stats:     func(ctx context.Context) (any, error) { return stats(ctx, st) },
		Logger:    logger,
		ReadToken: os.Getenv(readTokenEnv),
	}
	if e.o.enableResend {
		r, err := audit.NewResender(audit.ResenderConfig{URI: e.o.uri, Store: st, LoopBackExchange: e.o.loopBack, ManagementURL: e.o.mgmtURL, Logger: logger})
		if err != nil {
			return fail(e.stderr, err)
		}
		defer r.Close()
		cfg.EnableResend, cfg.ResendToken, cfg.Resender = true, os.Getenv(tokenEnv), r
	}
	h, err := httpapi.New(cfg)
	if err != nil {
		return fail(e.stderr, err)
	}
	ln, err := net.Listen("tcp", e.o.listen)
	if err != nil {
		return fail(e.stderr, err)
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: serveReadHeaderTimeout,
		ReadTimeout:       serveReadTimeout,
		WriteTimeout:      serveWriteTimeout,
		IdleTimeout:       serveIdleTimeout,
		MaxHeaderBytes:    64 << 10,
	}
	mode := "read-only"
	if e.o.enableResend {
		mode = "resend enabled (bearer token)"
	}
	if cfg.ReadToken != "" {
		mode += ", reads need $" + readTokenEnv
	}
	fmt.Fprintf(e.stderr, "auditctl: serving http://%s (%s)\n", ln.Addr(), mode)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fail(e.stderr, err)
	case <-e.ctx.Done():
	}
	ctx, cancel := context.WithTimeout(context.Background(), serveShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		return fail(e.stderr, fmt.Errorf("shutdown: %w", err))
	}
	fmt.Fprintln(e.stderr, "auditctl: stopped")
	return exitOK
}
