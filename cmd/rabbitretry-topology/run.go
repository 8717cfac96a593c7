package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/cliflags"
	"github.com/rabbitretry/rabbitretry/router"

	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// Exit codes.
const (
	exitOK    = 0
	exitFail  = 1 // the operation failed
	exitUsage = 2 // bad command line
)

const (
	prog           = "rabbitretry-topology"
	defaultURI     = "amqp://guest:guest@localhost:5672/"
	defaultMgmtURL = "http://guest:guest@localhost:15672/"
	mgmtEnv        = "RABBITMQ_MANAGEMENT_URL"
)

// options holds every flag.
type options struct {
	uri, mgmtURL, queue, tiers, queueType string
	maxAttempts                           int
	waitEx, poisonEx, loopBackEx          string
	dryRun, json                          bool
	cascade                               cascadeOptions
}

func (o *options) flags(fs *flag.FlagSet) {
	fs.StringVar(&o.queue, "queue", "", "originating `queue` (required)")
	fs.StringVar(&o.uri, "uri", "", "AMQP `URI` (default $AMQP_URI, else "+defaultURI+")")
	fs.StringVar(&o.mgmtURL, "management-url", "", "management HTTP API base `URL` (default $"+mgmtEnv+", else "+defaultMgmtURL+")")
	fs.StringVar(&o.tiers, "tiers", "", "configured delay `tiers`, comma-separated durations such as 1s,2s,4s (default: the library's default tiers for --max-attempts)")
	fs.IntVar(&o.maxAttempts, "max-attempts", 5, "`N`, Config.MaxAttempts the default tiers derive from")
	fs.StringVar(&o.queueType, "queue-type", "", "queue `type`: classic or quorum (default classic; cascade: quorum, the level queues')")
	fs.StringVar(&o.waitEx, "wait-exchange", "", "wait `exchange` (default rabbitretry.wait)")
	fs.StringVar(&o.poisonEx, "poison-exchange", "", "poison `exchange` (default rabbitretry.poison)")
	fs.StringVar(&o.loopBackEx, "loopback-exchange", "", "loop-back `exchange` (default rabbitretry.loopback)")
	fs.BoolVar(&o.dryRun, "dry-run", false, "tidy: report what would be deleted; change nothing. cascade move: count what would move; move nothing")
	fs.BoolVar(&o.json, "json", false, "show, cascade census: print the report as JSON")
	o.cascade.flags(fs)
}

const usageText = `Usage: rabbitretry-topology show|tidy --queue Q [--uri AMQP_URI] [--management-url URL]
           [--tiers 1s,2s,4s | --max-attempts N] [--queue-type classic|quorum]
           [--wait-exchange X] [--poison-exchange X] [--loopback-exchange X] [--dry-run] [--json]
       rabbitretry-topology cascade waiting|census|move|redirect|unredirect [--uri AMQP_URI]
           [--cascade-prefix P] [--grain 100ms] [--levels N] [--queue-type quorum|classic]
           [--from Q --to Q2] [--level N,...] [--dry-run] [--json]

Show and tidy the retry topology of originating queue Q: Q, its wait queues
(one per tier), its poison queue, and the orphan wait queues that tiers of
an earlier deploy left behind (their messages still come back to Q when
their TTL expires).

Commands:
  show   print queue, role, tier, messages and state (ok, missing, orphan);
         message counts come from the management API and lag a few seconds
  tidy   delete the empty orphan wait queues (the broker refuses to delete
         one holding messages); list the ones kept and why

The delay cascade (amqpretry/cascade, shared by all queues of a vhost):
  cascade waiting   messages per level queue (passive declares; disturbs nothing)
  cascade census    take every waiting message out, count it per destination
                    and level (with earliest and latest due time), and put it
                    back with its remaining delay (copy and ack in one
                    transaction: interrupted, each is put back or untouched)
  cascade move      census that puts the messages for --from back for --to
                    (--dry-run: count only, move nothing)
  cascade redirect  bind --to with --from's key and unbind --from: waiting
                    and future messages for --from arrive at --to; stop
                    --from's services first (they would bind it again)
  cascade unredirect  undo redirect: bind --from again, then unbind --to's
                    binding of --from's key
The --cascade-prefix, --grain, --levels and --queue-type must be the
services' (cascade.Config).

The tiers, queue type and names must be the services' (amqpretry.Config).
Exit status: 0 ok, 1 operation failed, 2 usage error.

Flags:
`

// run is the whole program minus os.Exit: it parses args (without the
// program name), runs the command and returns the exit code. SIGINT and
// SIGTERM cancel it.
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return runContext(ctx, args, stdout, stderr)
}

func usageErr(stderr io.Writer, format string, args ...any) int {
	fmt.Fprintf(stderr, prog+": "+format+"\n", args...)
	fmt.Fprintf(stderr, "Run %q for usage.\n", prog+" -h")
	return exitUsage
}

// secrets are the passwords of the URLs given, scrubbed from every error.
type secrets []string

func (s secrets) fail(stderr io.Writer, err error) int {
	msg := strings.TrimPrefix(err.Error(), "amqpretry: ")
	for _, p := range s {
		if p != "" {
			msg = strings.ReplaceAll(msg, p, "xxxxx")
		}
	}
	fmt.Fprintf(stderr, "%s: %s\n", prog, msg)
	return exitFail
}

// runContext parses the flags and runs one command. Complexity (~29): the
// flag checks of every subcommand in one place, each a plain if; the
// cascade subcommands have their own (cascade.go).
func runContext(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	// Every message and usage error goes through stderr: no password of
	// --uri / --management-url / $AMQP_URI / $RABBITMQ_MANAGEMENT_URL in it.
	stderr = redact.Writer(stderr, redact.CommandLine(args, "AMQP_URI", mgmtEnv)...)
	o := &options{}
	fs := flag.NewFlagSet(prog, flag.ContinueOnError)
	fs.SetOutput(stderr)
	o.flags(fs)
	fs.Usage = func() {
		fmt.Fprint(stderr, usageText)
		fs.PrintDefaults()
	}
	pos, err := cliflags.ParseInterleaved(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage // the flag package printed the error and usage
	}
	if len(pos) == 0 {
		return usageErr(stderr, "missing command (show, tidy or cascade)")
	}
	name := pos[0]
	if name == "help" {
		fs.Usage()
		return exitOK
	}
	if name == "cascade" {
		return runCascade(ctx, o, pos[1:], stdout, stderr)
	}
	if name != "show" && name != "tidy" {
		return usageErr(stderr, "unknown command %q (want show, tidy or cascade)", name)
	}
	if err := o.cascade.unused(); err != nil {
		return usageErr(stderr, "%v", err)
	}
	if o.queueType == "" {
		o.queueType = amqpretry.QueueTypeClassic
	}
	if len(pos) > 1 {
		return usageErr(stderr, "%s: unexpected argument %q", name, pos[1])
	}
	if o.queue == "" {
		return usageErr(stderr, "%s: --queue is required (the originating queue, e.g. orders)", name)
	}
	if o.dryRun && name != "tidy" {
		return usageErr(stderr, "--dry-run applies to tidy and cascade move only")
	}
	if o.json && name != "show" {
		return usageErr(stderr, "--json applies to show and cascade census only")
	}
	tiers, err := parseTiers(o.tiers)
	if err != nil {
		return usageErr(stderr, "--tiers: %v", err)
	}
	o.defaultURI()
	if o.mgmtURL == "" {
		o.mgmtURL = os.Getenv(mgmtEnv)
	}
	if o.mgmtURL == "" {
		o.mgmtURL = defaultMgmtURL
	}
	au, err := amqp.ParseURI(o.uri)
	if err != nil {
		return usageErr(stderr, "--uri: %v", err)
	}
	mu, err := url.Parse(o.mgmtURL)
	if err != nil || (mu.Scheme != "http" && mu.Scheme != "https") || mu.Host == "" {
		return usageErr(stderr, "--management-url: want an http(s) URL such as %s", defaultMgmtURL)
	}
	sec := secrets{au.Password}
	if p, ok := mu.User.Password(); ok {
		sec = append(sec, p)
	}

	cfg := amqpretry.Config{
		URI: o.uri, Subscriber: wamqp.NewDurableQueueConfig(o.uri), QueueType: o.queueType, Policy: router.Policy{MaxAttempts: o.maxAttempts, Backoff: retrymeta.DefaultBackoff},
		Mode: amqpretry.Tiers(tiers...), Logger: watermill.NopLogger{},
		Naming: amqpretry.Naming{WaitExchange: o.waitEx, PoisonExchange: o.poisonEx, LoopBackExchange: o.loopBackEx},
	}
	if err := cfg.Validate(); err != nil {
		return usageErr(stderr, "%s", strings.TrimPrefix(err.Error(), "amqpretry."))
	}
	r, err := amqpretry.New(cfg) // connects the publisher tidy deletes through
	if err != nil {
		return sec.fail(stderr, err)
	}
	defer r.Close()
	if err := r.Topology().CheckNames(o.queue); err != nil {
		return usageErr(stderr, "--queue: %v", strings.TrimPrefix(err.Error(), "amqpretry: "))
	}
	if name == "show" {
		return show(ctx, r, o, au.Vhost, sec, stdout, stderr)
	}
	return tidy(ctx, r, o, au.Vhost, sec, stdout, stderr)
}

// defaultURI fills in --uri: $AMQP_URI, else defaultURI.
func (o *options) defaultURI() {
	if o.uri == "" {
		o.uri = os.Getenv("AMQP_URI")
	}
	if o.uri == "" {
		o.uri = defaultURI
	}
}

// parseTiers parses "1s,2s,4s"; empty is nil (the default tiers).
func parseTiers(s string) ([]time.Duration, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var tiers []time.Duration
	for _, f := range strings.Split(s, ",") {
		d, err := time.ParseDuration(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("%q is not a duration (e.g. 500ms, 2s, 1m)", strings.TrimSpace(f))
		}
		tiers = append(tiers, d)
	}
	return tiers, nil
}

func show(ctx context.Context, r *amqpretry.Retry, o *options, vhost string, sec secrets, stdout, stderr io.Writer) int {
	rep, err := r.Topology().Inspect(ctx, o.mgmtURL, vhost, o.queue)
	if err != nil {
		return sec.fail(stderr, err)
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return sec.fail(stderr, err)
		}
		return exitOK
	}
	fmt.Fprintf(stdout, "Queue %q on vhost %q; tiers %s\n\n", o.queue, vhost, formatTiers(r.Topology().Tiers()))
	fmt.Fprint(stdout, rep.String())
	fmt.Fprintln(stdout)
	if len(rep.Missing) > 0 {
		fmt.Fprintf(stdout, "%d missing: declared when a subscriber with these settings starts (or the settings given here are not the services').\n", len(rep.Missing))
	}
	if len(rep.Orphans) > 0 {
		fmt.Fprintf(stdout, "%d orphan wait queue(s): tiers no longer configured; their messages still come back to %q when their TTL expires. \"tidy\" deletes the empty ones.\n", len(rep.Orphans), o.queue)
	}
	if len(rep.Missing) == 0 && len(rep.Orphans) == 0 {
		fmt.Fprintln(stdout, "Topology as configured: nothing missing, no orphans.")
	}
	return exitOK
}

func tidy(ctx context.Context, r *amqpretry.Retry, o *options, vhost string, sec secrets, stdout, stderr io.Writer) int {
	if o.dryRun {
		rep, err := r.Topology().Inspect(ctx, o.mgmtURL, vhost, o.queue)
		if err != nil {
			return sec.fail(stderr, err)
		}
		if len(rep.Orphans) == 0 {
			fmt.Fprintf(stdout, "No orphan wait queues for %q.\n", o.queue)
			return exitOK
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "QUEUE\tTIER\tMESSAGES\tWOULD")
		for _, q := range rep.Orphans {
			would := "delete (if still empty)"
			if q.Messages > 0 {
				would = "keep (not empty)"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", q.Name, retrymeta.FormatDelay(q.Tier), q.Messages, would)
		}
		_ = tw.Flush()
		fmt.Fprintln(stdout, "Dry run: nothing deleted. Message counts are the management API's and lag a few seconds; tidy decides on the broker's.")
		return exitOK
	}
	deleted, kept, err := r.Topology().TidyOrphans(ctx, o.mgmtURL, vhost, o.queue, r.Publisher().Channel)
	for _, d := range deleted {
		fmt.Fprintf(stdout, "deleted  %s\n", d)
	}
	var longest time.Duration
	for _, k := range kept {
		fmt.Fprintf(stdout, "kept     %s (tier %s, %s: its messages come back to %q within %s)\n",
			k.Name, retrymeta.FormatDelay(k.Tier), keptReason(k), o.queue, retrymeta.FormatDelay(k.Tier))
		longest = max(longest, k.Tier)
	}
	if err != nil {
		return sec.fail(stderr, err)
	}
	switch {
	case len(deleted) == 0 && len(kept) == 0:
		fmt.Fprintf(stdout, "No orphan wait queues for %q.\n", o.queue)
	case len(kept) > 0:
		fmt.Fprintf(stdout, "%d deleted, %d kept: run tidy again in %s.\n", len(deleted), len(kept), retrymeta.FormatDelay(longest))
	default:
		fmt.Fprintf(stdout, "%d deleted.\n", len(deleted))
	}
	return exitOK
}

func keptReason(k amqpretry.OrphanKept) string {
	if k.Messages > 0 {
		return fmt.Sprintf("%s, %d message(s)", k.Reason, k.Messages)
	}
	return k.Reason
}

func formatTiers(tiers []time.Duration) string {
	s := make([]string, len(tiers))
	for i, d := range tiers {
		s[i] = retrymeta.FormatDelay(d)
	}
	return strings.Join(s, ",")
}
