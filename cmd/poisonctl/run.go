package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/rabbitretry/rabbitretry/internal/cliflags"
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
				fs.StringVar(&o.loopBack, "loop-back-exchange", admin.DefaultLoopBackExchange, "loop-back exchange of the retry topology")
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

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// jsonOut writes v as JSON and returns code, or exitFail if writing failed.
func jsonOut(stdout, stderr io.Writer, v any, code int) int {
	if err := writeJSON(stdout, v); err != nil {
		return fail(stderr, fmt.Errorf("writing output: %w", err))
	}
	return code
}

// oneLine replaces control characters (newlines, tabs) by spaces so a value
// fits one table cell.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
}

// truncate shortens s to at most n runes, ending with "..." when cut.
func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-3]) + "..."
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
	return t.UTC().Format(time.RFC3339)
}

func cmdList(ctx context.Context, a *admin.Admin, o *options, f admin.Filter, _ []string, stdout, stderr io.Writer) int {
	msgs, err := a.List(ctx, o.queue, f)
	if err != nil {
		return fail(stderr, err)
	}
	if o.json {
		if msgs == nil {
			msgs = []admin.Message{}
		}
		return jsonOut(stdout, stderr, msgs, exitOK)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "UUID\tPOISONED AT\tATTEMPTS\tCLASS\tORIGINAL QUEUE\tREASON")
	for _, m := range msgs {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", orDash(oneLine(m.UUID)), formatTime(m.PoisonedAt), m.Attempts,
			orDash(oneLine(m.Class)), orDash(oneLine(m.OriginalQueue)), truncate(oneLine(m.Reason), reasonWidth))
	}
	if err := tw.Flush(); err != nil {
		return fail(stderr, fmt.Errorf("writing output: %w", err))
	}
	fmt.Fprintf(stderr, "%d message(s) in %s matched\n", len(msgs), o.queue)
	return exitOK
}

func cmdShow(ctx context.Context, a *admin.Admin, o *options, _ admin.Filter, pos []string, stdout, stderr io.Writer) int {
	uuid := pos[0]
	msgs, err := a.List(ctx, o.queue, admin.Filter{UUIDs: []string{uuid}})
	if err != nil {
		return fail(stderr, err)
	}
	if len(msgs) == 0 {
		fmt.Fprintf(stderr, "poisonctl: message %q not found in queue %q\n", uuid, o.queue)
		return exitFail
	}
	if len(msgs) > 1 {
		fmt.Fprintf(stderr, "poisonctl: note: %d messages in %q have UUID %q; showing the first\n", len(msgs), o.queue, uuid)
	}
	m := msgs[0]
	if o.json {
		return jsonOut(stdout, stderr, m, exitOK)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	for _, row := range [][2]string{
		{"UUID", m.UUID},
		{"Poisoned at", formatTime(m.PoisonedAt)},
		{"Attempts", fmt.Sprint(m.Attempts)},
		{"Class", m.Class},
		{"Reason", m.Reason},
		{"Last error", m.LastError},
		{"Handler", m.Handler},
		{"Topic", m.Topic},
		{"Subscriber", m.Subscriber},
		{"Original queue", m.OriginalQueue},
		{"Original exchange", m.OriginalExchange},
		{"Original routing key", m.OriginalRoutingKey},
		{"First failure", formatTime(m.FirstFailure)},
		{"Last failure", formatTime(m.LastFailure)},
		{"Redelivered", fmt.Sprint(m.Redelivered)},
	} {
		fmt.Fprintf(tw, "%s:\t%s\n", row[0], oneLine(orDash(row[1])))
	}
	_ = tw.Flush()
	fmt.Fprintln(stdout, "Headers:")
	keys := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	for _, k := range keys {
		fmt.Fprintf(tw, "  %s:\t%s\n", oneLine(k), oneLine(m.Headers[k]))
	}
	_ = tw.Flush()
	if utf8.Valid(m.Body) {
		fmt.Fprintf(stdout, "Body (%d bytes):\n%s\n", len(m.Body), m.Body)
	} else {
		fmt.Fprintf(stdout, "Body (%d bytes, binary, base64):\n%s\n", len(m.Body), base64.StdEncoding.EncodeToString(m.Body))
	}
	return exitOK
}

// progressPrinter prints "replayed done/total" to w at most every 100
// messages or every second, and at the end.
func progressPrinter(w io.Writer) func(done, total int) {
	var last time.Time
	return func(done, total int) {
		if done == total || done%100 == 0 || time.Since(last) >= time.Second {
			fmt.Fprintf(w, "replayed %d/%d\n", done, total)
			last = time.Now()
		}
	}
}

type replayJSON struct {
	DryRun bool `json:"dry_run"`
	admin.ReplayResult
	Errors []string `json:"errors"`
	Error  string   `json:"error,omitempty"`
}

func cmdReplay(ctx context.Context, a *admin.Admin, o *options, f admin.Filter, _ []string, stdout, stderr io.Writer) int {
	opts := admin.ReplayOptions{DryRun: o.dryRun, DefaultQueue: o.defaultQueue}
	if !o.dryRun {
		opts.Progress = progressPrinter(stderr)
	}
	res, err := a.Replay(ctx, o.queue, f, opts)
	return reportReplay(o, res, err, stdout, stderr)
}

// reportReplay prints the outcome of a replay and returns the exit status:
// exitFail if Replay failed, a message could not be replayed, or any
// matched message was left in the poison queue (ReplayResult.Left).
func reportReplay(o *options, res admin.ReplayResult, err error, stdout, stderr io.Writer) int {
	code := exitOK
	if err != nil || len(res.Errors) > 0 || res.Left > 0 {
		code = exitFail
	}
	if o.json {
		out := replayJSON{DryRun: o.dryRun, ReplayResult: res, Errors: []string{}}
		for _, e := range res.Errors {
			out.Errors = append(out.Errors, e.Error())
		}
		if err != nil {
			out.Error = err.Error()
		}
		if c := jsonOut(stdout, stderr, out, code); c != exitOK {
			return c
		}
		if err != nil {
			return fail(stderr, err)
		}
		return code
	}
	for i, e := range res.Errors {
		if i == maxErrorLines {
			fmt.Fprintf(stderr, "poisonctl: ... and %d more message errors\n", len(res.Errors)-maxErrorLines)
			break
		}
		fmt.Fprintf(stderr, "poisonctl: %v\n", e)
	}
	if res.Skipped > 0 {
		fmt.Fprintf(stderr, "poisonctl: %d message(s) have no original queue; pass --default-queue to replay them\n", res.Skipped)
	}
	if len(res.Duplicated) > 0 {
		fmt.Fprintf(stderr, "poisonctl: %d message(s) may be both in their original queue and still in %s (copy enqueued, removal unconfirmed): %s\n",
			len(res.Duplicated), o.queue, strings.Join(res.Duplicated, ", "))
	}
	if o.dryRun {
		fmt.Fprintf(stdout, "dry run: would replay %d of %d matching message(s) from %s; %d would be skipped\n",
			res.Replayed, res.Matched, o.queue, res.Skipped)
	} else {
		fmt.Fprintf(stdout, "replayed %d of %d matching message(s) from %s; %d skipped, %d failed; %d left in %s\n",
			res.Replayed, res.Matched, o.queue, res.Skipped, len(res.Errors)-res.Skipped, res.Left, o.queue)
	}
	if err != nil {
		return fail(stderr, err)
	}
	return code
}

// inDoubt returns the UUID of the message err names as in doubt (a
// *admin.MessageError matching target), or nil.
func inDoubt(err, target error) []string {
	var me *admin.MessageError
	if errors.Is(err, target) && errors.As(err, &me) {
		return []string{me.UUID}
	}
	return []string{}
}

func cmdMove(ctx context.Context, a *admin.Admin, o *options, f admin.Filter, _ []string, stdout, stderr io.Writer) int {
	n, err := a.Move(ctx, o.queue, o.to, f, o.dryRun)
	doubt := inDoubt(err, admin.ErrMaybeDuplicated)
	if o.json {
		out := map[string]any{"dry_run": o.dryRun, "moved": n, "to": o.to, "duplicated": doubt}
		if err != nil {
			out["error"] = err.Error()
		}
		if c := jsonOut(stdout, stderr, out, exitOK); c != exitOK {
			return c
		}
	} else if o.dryRun {
		fmt.Fprintf(stdout, "dry run: would move %d message(s) from %s to %s\n", n, o.queue, o.to)
	} else {
		fmt.Fprintf(stdout, "moved %d message(s) from %s to %s\n", n, o.queue, o.to)
	}
	if len(doubt) > 0 && !o.json {
		fmt.Fprintf(stderr, "poisonctl: message %s may be both in %s and still in %s (copy enqueued, removal unconfirmed)\n", doubt[0], o.to, o.queue)
	}
	if err != nil {
		return fail(stderr, err)
	}
	return exitOK
}

func cmdPurge(ctx context.Context, a *admin.Admin, o *options, f admin.Filter, _ []string, stdout, stderr io.Writer) int {
	n, err := a.Purge(ctx, o.queue, f, o.dryRun)
	doubt := inDoubt(err, admin.ErrRemovalUnconfirmed)
	if o.json {
		out := map[string]any{"dry_run": o.dryRun, "purged": n, "unconfirmed": doubt}
		if err != nil {
			out["error"] = err.Error()
		}
		if c := jsonOut(stdout, stderr, out, exitOK); c != exitOK {
			return c
		}
	} else if o.dryRun {
		fmt.Fprintf(stdout, "dry run: would delete %d message(s) from %s\n", n, o.queue)
	} else {
		fmt.Fprintf(stdout, "deleted %d message(s) from %s\n", n, o.queue)
	}
	if len(doubt) > 0 && !o.json {
		fmt.Fprintf(stderr, "poisonctl: message %s may or may not have been deleted (removal unconfirmed)\n", doubt[0])
	}
	if err != nil {
		return fail(stderr, err)
	}
	return exitOK
}

func cmdStats(ctx context.Context, a *admin.Admin, o *options, _ admin.Filter, _ []string, stdout, stderr io.Writer) int {
	st, err := a.Stats(ctx, o.queue)
	if err != nil {
		return fail(stderr, err)
	}
	if o.json {
		return jsonOut(stdout, stderr, st, exitOK)
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "queue\t%s\ndepth\t%d\nconsumers\t%d\nscanned\t%d\noldest\t%s\nnewest\t%s\n",
		st.Queue, st.Depth, st.Consumers, st.Scanned, formatTime(st.Oldest), formatTime(st.Newest))
	for _, sec := range []struct {
		title  string
		counts map[string]int
	}{{"CLASS", st.ByClass}, {"HANDLER", st.ByHandler}, {"ORIGINAL QUEUE", st.ByOriginalQueue}} {
		fmt.Fprintf(tw, "\n%s\tCOUNT\n", sec.title)
		for _, k := range sortedByCount(sec.counts) {
			name := k
			if name == "" {
				name = "(none)"
			}
			fmt.Fprintf(tw, "%s\t%d\n", oneLine(name), sec.counts[k])
		}
	}
	if err := tw.Flush(); err != nil {
		return fail(stderr, fmt.Errorf("writing output: %w", err))
	}
	return exitOK
}

// sortedByCount returns the keys by descending count, then name.
func sortedByCount(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if m[keys[i]] != m[keys[j]] {
			return m[keys[i]] > m[keys[j]]
		}
		return keys[i] < keys[j]
	})
	return keys
}
