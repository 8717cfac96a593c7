package main

import (
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

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
			if res.Status == auditconst.StatusWouldSend {
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
