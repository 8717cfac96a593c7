package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/cascadecore"
)

// cascadeOptions are the flags of the cascade subcommands.
type cascadeOptions struct {
	prefix, from, to, levelList string
	grain                       time.Duration
	levels                      int
}

func (c *cascadeOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.prefix, "cascade-prefix", "", "cascade: name `prefix` of the delay cascade (default "+cascadecore.DefaultPrefix+")")
	fs.DurationVar(&c.grain, "grain", 0, "cascade: the cascade's `grain` (default 100ms)")
	fs.IntVar(&c.levels, "levels", 0, "cascade: number of `levels` (default: derived from --grain, 26 for 100ms)")
	fs.StringVar(&c.from, "from", "", "cascade move, redirect, unredirect: the destination `queue` to take messages from")
	fs.StringVar(&c.to, "to", "", "cascade move, redirect, unredirect: the destination `queue` to give them to (must exist)")
	fs.StringVar(&c.levelList, "level", "", "cascade census, move: only these `levels`, comma-separated (default all)")
}

// unused reports a cascade flag given to show or tidy.
func (c *cascadeOptions) unused() error {
	switch {
	case c.prefix != "":
		return errors.New("--cascade-prefix applies to the cascade commands only")
	case c.grain != 0:
		return errors.New("--grain applies to the cascade commands only")
	case c.levels != 0:
		return errors.New("--levels applies to the cascade commands only")
	case c.from != "" || c.to != "":
		return errors.New("--from and --to apply to cascade move, redirect and unredirect only")
	case c.levelList != "":
		return errors.New("--level applies to cascade census and move only")
	}
	return nil
}

func parseLevels(s string) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("%q is not a level number", strings.TrimSpace(f))
		}
		out = append(out, n)
	}
	return out, nil
}

// runCascade runs "cascade SUB": waiting, census, move, redirect or
// unredirect.
func runCascade(ctx context.Context, o *options, pos []string, stdout, stderr io.Writer) int {
	if len(pos) == 0 {
		return usageErr(stderr, "cascade: missing subcommand (waiting, census, move, redirect or unredirect)")
	}
	sub := pos[0]
	if len(pos) > 1 {
		return usageErr(stderr, "cascade %s: unexpected argument %q", sub, pos[1])
	}
	if msg := checkCascadeFlags(o, sub); msg != "" {
		return usageErr(stderr, "%s", msg)
	}
	co := &o.cascade
	levels, err := parseLevels(co.levelList)
	if err != nil {
		return usageErr(stderr, "--level: %v", err)
	}
	cfg, sec, msg := cascadeConfig(o)
	if msg != "" {
		return usageErr(stderr, "%s", msg)
	}
	if sub == "census" || sub == "move" {
		return runCensus(ctx, o, sub, cfg, levels, sec, stdout, stderr)
	}
	conn, err := amqp.DialConfig(o.uri, amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
	if err != nil {
		return sec.fail(stderr, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return sec.fail(stderr, err)
	}
	defer ch.Close()
	switch sub {
	case "redirect":
		if err := cfg.Redirect(ch, co.from, co.to); err != nil {
			return sec.fail(stderr, err)
		}
		fmt.Fprintf(stdout, "Redirected: messages for %q now arrive at %q (binding %q on %s); %q is unbound.\n",
			co.from, co.to, strings.Repeat("*.", cfg.Levels)+co.from, cfg.DeliveryExchange(), co.from)
		fmt.Fprintf(stdout, "Anything that binds %q again (its Delayer, Publisher or subscriber) makes its messages arrive at both queues.\n", co.from)
		fmt.Fprintf(stdout, "Undo: %s cascade unredirect --from %s --to %s (same cascade flags).\n", prog, co.from, co.to)
		return exitOK
	case "unredirect":
		if err := cfg.Unredirect(ch, co.from, co.to); err != nil {
			return sec.fail(stderr, err)
		}
		fmt.Fprintf(stdout, "Unredirected: messages for %q arrive at %q again (binding %q on %s); %q no longer gets them.\n",
			co.from, co.from, strings.Repeat("*.", cfg.Levels)+co.from, cfg.DeliveryExchange(), co.to)
		return exitOK
	}
	counts, err := cfg.Waiting(ctx, ch)
	if err != nil {
		return sec.fail(stderr, err)
	}
	printWaiting(stdout, cfg, counts)
	return exitOK
}

// checkCascadeFlags returns a usage message for a subcommand sub that is
// unknown or given flags it does not take, "" when all is well. Cyclomatic
// complexity 20: a flat list of independent rules, one branch each, read
// top to bottom as the usage text states them.
func checkCascadeFlags(o *options, sub string) string {
	co := &o.cascade
	switch sub {
	case "waiting", "census", "move", "redirect", "unredirect":
	default:
		return fmt.Sprintf("cascade: unknown subcommand %q (want waiting, census, move, redirect or unredirect)", sub)
	}
	if showFlagsSet(o) || (o.mgmtURL != "" && sub != "waiting") {
		return fmt.Sprintf("cascade %s: --queue, --tiers, --management-url and the exchange flags apply to show and tidy only (--management-url also to cascade waiting)", sub)
	}
	if o.dryRun && sub != "move" {
		return "--dry-run applies to tidy and cascade move only"
	}
	if o.json && sub != "census" {
		return "--json applies to show and cascade census only"
	}
	moving := sub == "move" || sub == "redirect" || sub == "unredirect"
	if moving && (co.from == "" || co.to == "") {
		return fmt.Sprintf("cascade %s: --from and --to are required", sub)
	}
	if !moving && (co.from != "" || co.to != "") {
		return "--from and --to apply to cascade move, redirect and unredirect only"
	}
	if co.levelList != "" && sub != "census" && sub != "move" {
		return "--level applies to cascade census and move only"
	}
	return ""
}

// showFlagsSet reports a flag of show and tidy that the cascade commands
// do not take.
func showFlagsSet(o *options) bool {
	return o.queue != "" || o.tiers != "" || o.waitEx != "" || o.poisonEx != "" || o.loopBackEx != ""
}

// cascadeConfig builds the cascadecore.Config the flags describe, with Grain
// and Levels filled in, and the secrets to hide in errors; msg is a usage
// message ("" when the flags are valid).
func cascadeConfig(o *options) (cfg cascadecore.Config, sec secrets, msg string) {
	co := &o.cascade
	o.defaultURI()
	au, err := amqp.ParseURI(o.uri)
	if err != nil {
		return cfg, nil, fmt.Sprintf("--uri: %v", err)
	}
	sec = secrets{au.Password}
	cfg = cascadecore.Config{Prefix: co.prefix, Grain: co.grain, Levels: co.levels, QueueType: o.queueType}
	if o.mgmtURL != "" { // cascade waiting: dead-letter backlogs and length limits too
		mu, err := url.Parse(o.mgmtURL)
		if err != nil || (mu.Scheme != "http" && mu.Scheme != "https") || mu.Host == "" {
			return cfg, nil, fmt.Sprintf("--management-url: want an http(s) URL such as %s", defaultMgmtURL)
		}
		if p, ok := mu.User.Password(); ok {
			sec = append(sec, p)
		}
		cfg.ManagementURL, cfg.Vhost = o.mgmtURL, au.Vhost
	}
	if err := cfg.Validate(); err != nil {
		return cfg, nil, strings.TrimPrefix(err.Error(), "cascade.")
	}
	if cfg.Grain == 0 {
		cfg.Grain = cascadecore.DefaultGrain
	}
	if cfg.Levels == 0 {
		key, _ := cfg.RoutingKey(0, "q") // L words "0", then "q"
		cfg.Levels = strings.Count(key, ".")
	}
	return cfg, sec, ""
}

// runCensus runs "cascade census" and "cascade move".
func runCensus(ctx context.Context, o *options, sub string, cfg cascadecore.Config, levels []int, sec secrets, stdout, stderr io.Writer) int {
	co := &o.cascade
	opts := cascadecore.CensusOptions{Levels: levels, DryRun: o.dryRun}
	if sub == "move" {
		opts.Move = map[string]string{co.from: co.to}
	}
	cfg.URI = o.uri
	rep, err := cascadecore.Census(ctx, cfg, opts)
	if err != nil {
		if rep.Taken > 0 {
			fmt.Fprintf(stderr, "%s: stopped after taking %d message(s), %d put back; the others stay in their level queues\n", prog, rep.Taken, rep.PutBack)
		}
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
	printCensus(stdout, cfg, sub, co, o.dryRun, rep)
	return exitOK
}

// printWaiting prints "cascade waiting"'s table and summary.
func printWaiting(stdout io.Writer, cfg cascadecore.Config, counts []cascadecore.LevelCount) {
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if cfg.ManagementURL == "" {
		fmt.Fprintln(tw, "LEVEL\tQUEUE\tTTL\tMESSAGES\tCONSUMERS")
	} else {
		fmt.Fprintln(tw, "LEVEL\tQUEUE\tTTL\tMESSAGES\tCONSUMERS\tDEAD-LETTERING\tLENGTH LIMIT")
	}
	total, dlx, limited, unknown := 0, 0, 0, 0
	for _, c := range counts {
		total += c.Messages
		if cfg.ManagementURL == "" {
			fmt.Fprintf(tw, "%d\t%s\t%v\t%d\t%d\n", c.Level, c.Queue, c.TTL, c.Messages, c.Consumers)
			continue
		}
		dl, limit := "-", c.LengthLimit
		if c.DeadLettering >= 0 {
			dl = fmt.Sprint(c.DeadLettering)
			dlx += c.DeadLettering
		} else {
			unknown++
		}
		if limit == "" {
			limit = "-"
		} else {
			limited++
		}
		fmt.Fprintf(tw, "%d\t%s\t%v\t%d\t%d\t%s\t%s\n", c.Level, c.Queue, c.TTL, c.Messages, c.Consumers, dl, limit)
	}
	_ = tw.Flush()
	if cfg.ManagementURL == "" {
		fmt.Fprintf(stdout, "%d message(s) waiting in %d levels (ready counts; per destination: cascade census; dead-letter backlogs: --management-url).\n", total, len(counts))
		return
	}
	fmt.Fprintf(stdout, "%d message(s) waiting in %d levels, and %d in dead-letter backlogs (between two levels; management API figures, refreshed every ~5 s", total, len(counts), dlx)
	if unknown > 0 {
		fmt.Fprintf(stdout, "; none yet for %d level(s), shown as -", unknown)
	}
	fmt.Fprintln(stdout, ").")
	if limited > 0 {
		fmt.Fprintf(stdout, "%d level queue(s) have a length limit: a full level refuses scheduled messages and holds the level above's for minutes; exclude the levels from length-limit policies.\n", limited)
	}
}

func printCensus(w io.Writer, cfg cascadecore.Config, sub string, co *cascadeOptions, dryRun bool, rep cascadecore.CensusReport) {
	now := time.Now()
	due := func(t time.Time) string {
		return fmt.Sprintf("%s (in %v)", t.UTC().Format(time.RFC3339), t.Sub(now).Round(100*time.Millisecond))
	}
	if len(rep.Destinations) == 0 {
		fmt.Fprintln(w, "No messages waiting in the cascade.")
	} else {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "DESTINATION\tMESSAGES\tEARLIEST DUE\tLATEST DUE\tNOTE")
		for _, d := range rep.Destinations {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\n", d.Queue, d.Messages, due(d.EarliestDue), due(d.LatestDue), entryNote(d, dryRun))
		}
		_ = tw.Flush()
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "LEVEL\tTTL\tDESTINATION\tMESSAGES\tEARLIEST DUE\tLATEST DUE")
		for _, e := range rep.Entries {
			fmt.Fprintf(tw, "%d\t%v\t%s\t%d\t%s\t%s\n", e.Level, time.Duration(1<<uint(e.Level))*cfg.Grain, e.Queue, e.Messages, due(e.EarliestDue), due(e.LatestDue))
		}
		_ = tw.Flush()
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "Counted %d message(s) in %v; each taken out and put back with its remaining delay",
		rep.Counted, rep.Finished.Sub(rep.Started).Round(time.Millisecond))
	if rep.Returned > 0 {
		fmt.Fprintf(w, " (%d more deliveries, mostly its own put-back copies, left in their level queues)", rep.Returned)
	}
	if rep.Foreign > 0 {
		fmt.Fprintf(w, "; %d with a key that is not this cascade's (wrong --levels?) put back unchanged", rep.Foreign)
	}
	fmt.Fprintln(w, ".")
	if sub == "move" {
		if dryRun {
			fmt.Fprintf(w, "Dry run: %d message(s) for %q would move to %q; all were put back unchanged.\n", rep.Moved, co.from, co.to)
		} else {
			fmt.Fprintf(w, "Moved %d message(s) from %q to %q.\n", rep.Moved, co.from, co.to)
		}
	}
}

func entryNote(d cascadecore.CensusEntry, dryRun bool) string {
	var notes []string
	if d.MovedTo != "" {
		if dryRun {
			notes = append(notes, "would move to "+d.MovedTo)
		} else {
			notes = append(notes, "moved to "+d.MovedTo)
		}
	}
	if d.NoDueHeader > 0 {
		notes = append(notes, fmt.Sprintf("%d without due time (latest possible shown)", d.NoDueHeader))
	}
	return strings.Join(notes, "; ")
}
