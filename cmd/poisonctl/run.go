package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/cliflags"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/poison/admin"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1 // the operation failed
	exitUsage = 2 // bad command line
)

const (
	defaultURI  = "amqp://guest:guest@localhost:5672/"
	reasonWidth = 60
	// maxErrorLines bounds the per-message errors printed by replay.
	maxErrorLines = 50
)

// run is the whole program minus os.Exit: it parses args (without the
// program name), runs the command and returns the exit code. SIGINT and
// SIGTERM cancel the operation cleanly (messages not yet handled stay in
// the queue).
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return runContext(ctx, args, stdout, stderr)
}

// options holds every flag of every command.
type options struct {
	uri, queue string
	json       bool

	reason, reasonRegexp, handler, class, originalQueue string
	since, until                                        string
	headers, uuids                                      multiFlag
	limit                                               int

	dryRun, yes      bool
	defaultQueue, to string
	loopBack         string
	connName         string
}

// multiFlag is a repeatable string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// command describes one subcommand.
type command struct {
	summary string
	args    string // positional arguments, for usage
	nargs   int
	filter  bool // accepts the filter flags
	flags   func(fs *flag.FlagSet, o *options)
	run     func(ctx context.Context, a *admin.Admin, o *options, f admin.Filter, pos []string, stdout, stderr io.Writer) int
}

// sub is what the parser needs of c.
func (c *command) sub() cliflags.Sub[*options] {
	return cliflags.Sub[*options]{Summary: c.summary, Args: c.args, NArgs: c.nargs, Filter: c.filter, Flags: c.flags}
}

var commands map[string]*command

var commandOrder = []string{"list", "show", "replay", "move", "purge", "stats"}

func init() {
	commands = map[string]*command{
		"list": {summary: "list matching messages", filter: true, run: cmdList},
		"show": {summary: "show one message with its headers and body", args: "<uuid>", nargs: 1, run: cmdShow},
		"replay": {summary: "send matching messages back to their original queue (via the loop-back exchange)", filter: true,
			flags: func(fs *flag.FlagSet, o *options) {
				fs.BoolVar(&o.dryRun, "dry-run", false, "report what would be replayed; change nothing")
				fs.StringVar(&o.defaultQueue, "default-queue", "", "queue for messages without a rabbitretry-original-queue header (default: skip them)")
				fs.StringVar(&o.loopBack, "loop-back-exchange", retrymeta.DefaultLoopBackExchange, "loop-back exchange of the retry topology")
			}, run: cmdReplay},
		"move": {summary: "move matching messages unchanged to another queue", filter: true,
			flags: func(fs *flag.FlagSet, o *options) {
				fs.StringVar(&o.to, "to", "", "destination queue (required)")
				fs.BoolVar(&o.dryRun, "dry-run", false, "report how many would be moved; change nothing")
			}, run: cmdMove},
		"purge": {summary: "delete matching messages for good (requires --yes or --dry-run)", filter: true,
			flags: func(fs *flag.FlagSet, o *options) {
				fs.BoolVar(&o.dryRun, "dry-run", false, "report how many would be deleted; change nothing")
				fs.BoolVar(&o.yes, "yes", false, "confirm the deletion")
			}, run: cmdPurge},
		"stats": {summary: "count messages by class, handler and original queue", run: cmdStats},
	}
}

func (o *options) globalFlags(fs *flag.FlagSet) {
	// Defaults are the current values, so flags given before the command
	// survive the command's flag set.
	fs.StringVar(&o.uri, "uri", o.uri, "AMQP `URI` (default $AMQP_URI, else "+defaultURI+")")
	fs.StringVar(&o.connName, "connection-name", o.connName, "connection `name` the broker shows for poisonctl (default rabbitretry-poison-admin)")
	fs.Lookup("uri").DefValue = "" // never print a password in the usage
	fs.StringVar(&o.queue, "queue", o.queue, "poison queue to operate on (required)")
	fs.BoolVar(&o.json, "json", o.json, "print JSON on stdout")
}

func (o *options) filterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.reason, "reason", "", "match messages whose reason contains `substring`")
	fs.StringVar(&o.reasonRegexp, "reason-regexp", "", "match messages whose reason matches `regexp` (RE2)")
	fs.StringVar(&o.handler, "handler", "", "match the Watermill handler `name`")
	fs.StringVar(&o.class, "class", "", "match the error `class` (e.g. permanent, malformed, exhausted)")
	fs.StringVar(&o.originalQueue, "original-queue", "", "match the original `queue`")
	fs.StringVar(&o.since, "since", "", "match messages poisoned at or after `time` (RFC 3339, or a duration ago such as 36h)")
	fs.StringVar(&o.until, "until", "", "match messages poisoned before `time` (RFC 3339, or a duration ago)")
	fs.Var(&o.headers, "header", "match header `k=v` exactly (repeatable; all must match)")
	fs.Var(&o.uuids, "uuid", "match message `uuid` (repeatable; any matches)")
	fs.IntVar(&o.limit, "limit", 0, "act on at most `n` matching messages (0 = all)")
}

func printUsage(w io.Writer) {
	fmt.Fprintf(w, `Usage: poisonctl [--uri URI] --queue POISON_QUEUE [--json] <command> [flags] [args]

Inspect and repair a rabbitretry poison queue. Every read requeues the
messages it does not remove (they come back flagged redelivered).

Commands:
`)
	for _, name := range commandOrder {
		c := commands[name]
		fmt.Fprintf(w, "  %-14s %s\n", strings.TrimSpace(name+" "+c.args), c.summary)
	}
	fmt.Fprintf(w, `
Run "poisonctl <command> -h" for the flags of a command.
Exit status: 0 ok, 1 operation failed, 2 usage error.
`)
}

// usageErr prints a usage error and returns exitUsage.
func usageErr(stderr io.Writer, format string, args ...any) int {
	return cliflags.Tool{Name: "poisonctl"}.UsageError(stderr, format, args...)
}

// fail prints an operation error and returns exitFail.
func fail(stderr io.Writer, err error) int {
	fmt.Fprintf(stderr, "poisonctl: %s\n", strings.TrimPrefix(err.Error(), "poison/admin: "))
	return exitFail
}

func runContext(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	// Every message and usage error goes through stderr: no password of
	// --uri / $AMQP_URI in it.
	stderr = redact.Writer(stderr, redact.CommandLine(args, "AMQP_URI")...)
	o := &options{}
	name, pos, code, ok := cliflags.Tool{
		Name: "poisonctl", Order: commandOrder, Global: o.globalFlags, PrintUsage: printUsage,
		Lookup: cliflags.Lookup(commands, (*command).sub, o, o.filterFlags),
	}.Parse(args, stderr)
	if !ok {
		return code
	}
	cmd := commands[name]
	if o.queue == "" {
		return usageErr(stderr, "%s: --queue is required (the poison queue, e.g. orders.poison)", name)
	}
	f, err := o.filter(time.Now())
	if err != nil {
		return usageErr(stderr, "%s: %v", name, err)
	}
	switch {
	case name == "purge" && !o.yes && !o.dryRun:
		return usageErr(stderr, "purge deletes messages for good: pass --yes to confirm, or --dry-run to see how many would be deleted")
	case name == "move" && o.to == "":
		return usageErr(stderr, "move: --to is required")
	}

	if o.uri == "" {
		o.uri = os.Getenv("AMQP_URI")
	}
	if o.uri == "" {
		o.uri = defaultURI
	}
	cfg := admin.Config{URI: o.uri, ConnectionName: o.connName}
	if o.loopBack != "" {
		cfg.LoopBackExchange = o.loopBack
	}
	a, err := admin.New(cfg)
	if err != nil {
		return fail(stderr, err)
	}
	defer a.Close()
	return cmd.run(ctx, a, o, f, pos, stdout, stderr)
}

// filter builds the admin.Filter from the filter flags; errors are usage
// errors.
func (o *options) filter(now time.Time) (admin.Filter, error) {
	f := admin.Filter{
		ReasonContains: o.reason,
		Handler:        o.handler,
		Class:          o.class,
		OriginalQueue:  o.originalQueue,
		UUIDs:          o.uuids,
		Limit:          o.limit,
	}
	if o.limit < 0 {
		return f, fmt.Errorf("--limit must be >= 0, got %d", o.limit)
	}
	if o.reasonRegexp != "" {
		re, err := regexp.Compile(o.reasonRegexp)
		if err != nil {
			return f, fmt.Errorf("--reason-regexp: %v", err)
		}
		f.ReasonRegexp = re
	}
	var err error
	if f.Since, err = parseWhen("since", o.since, now); err != nil {
		return f, err
	}
	if f.Until, err = parseWhen("until", o.until, now); err != nil {
		return f, err
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && f.Since.After(f.Until) {
		return f, errors.New("--since is after --until")
	}
	for _, kv := range o.headers {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return f, fmt.Errorf("--header %q: want key=value", kv)
		}
		if f.Headers == nil {
			f.Headers = map[string]string{}
		}
		f.Headers[k] = v
	}
	return f, nil
}

// parseWhen accepts RFC 3339 or a positive duration meaning "that long ago".
func parseWhen(name, s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("--%s %q: want an RFC 3339 time (2024-05-01T12:00:00Z) or a duration ago (36h)", name, s)
}
