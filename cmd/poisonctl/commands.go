package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/rabbitretry/rabbitretry/poison/admin"
)

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
