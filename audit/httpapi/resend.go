package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"reflect"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

// resendRequest is the body of POST /v1/resend; the fields are
// audit.ResendOptions's.
type resendRequest struct {
	// Filter selects the messages (audit.Filter's JSON: message_id,
	// headers, from/to as RFC 3339, ...); filter.limit is ignored.
	Filter audit.Filter `json:"filter"`
	// Mode is "to-queue" or "to-exchange". Required.
	Mode audit.ResendMode `json:"mode"`
	// Queue names the to-queue target (default: filter.queue, else the
	// queue of the message's attempts).
	Queue string `json:"queue,omitempty"`
	// DryRun reports what would be sent, sending nothing.
	DryRun bool `json:"dry_run,omitempty"`
	// Limit caps the messages (default 1000, as audit.ResendOptions.Limit).
	Limit int `json:"limit,omitempty"`
	// AllowAll must be true for a filter that selects every message or
	// more than the Resender's ConfirmAbove (audit.ErrEmptyFilter,
	// audit.ErrBroadResend: 400). Unless DryRun it needs ExpectedCount.
	AllowAll bool `json:"allow_all,omitempty"`
	// ExpectedCount is the "matched" of the dry run the operator checked.
	// Required (positive) with AllowAll unless DryRun; a resend whose
	// matched count differs sends nothing (audit.ErrCountMismatch: 409).
	ExpectedCount int `json:"expected_count,omitempty"`
}

// resendErrorResponse is the body of a resend that stopped part-way (500):
// the error and what was done until then.
type resendErrorResponse struct {
	Error  string             `json:"error"`
	Report audit.ResendReport `json:"report"`
}

// emptyFilter reports whether f selects every message (only Limit and
// After set, or nothing), as audit.Resender.Resend decides it before
// refusing with audit.ErrEmptyFilter: checked here so that such a request
// is a 400 before it takes the one-resend-at-a-time lock.
func emptyFilter(f audit.Filter) bool {
	f.Limit, f.After = 0, ""
	if len(f.Headers) == 0 {
		f.Headers = nil
	}
	return reflect.ValueOf(f).IsZero()
}

func (a *api) resend(w http.ResponseWriter, r *http.Request) {
	if !a.authorized(w, r) {
		return
	}
	var req resendRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, "request body: "+err.Error())
		return
	}
	if _, err := dec.Token(); err != io.EOF {
		writeError(w, http.StatusBadRequest, "request body: more than one JSON value")
		return
	}
	opts := audit.ResendOptions{Mode: req.Mode, Queue: req.Queue, DryRun: req.DryRun, Limit: req.Limit, AllowAll: req.AllowAll, ExpectedCount: req.ExpectedCount}
	if err := auditconst.CheckResendOptions(string(opts.Mode), opts.Queue, opts.Limit, opts.ExpectedCount); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if opts.AllowAll && !opts.DryRun && opts.ExpectedCount == 0 {
		writeError(w, http.StatusBadRequest, "allow_all needs expected_count: the matched count of a dry run of the same request")
		return
	}
	if err := validateFilter(req.Filter); err != nil {
		writeError(w, http.StatusBadRequest, "filter: "+err.Error())
		return
	}
	if emptyFilter(req.Filter) && !req.AllowAll {
		writeError(w, http.StatusBadRequest, audit.ErrEmptyFilter.Error())
		return
	}
	// One at a time: two operators (or a retried request) must not send
	// the same messages twice concurrently.
	if !a.resending.TryLock() {
		writeError(w, http.StatusConflict, "another resend is running; try again when it has finished")
		return
	}
	defer a.resending.Unlock()
	// A resend that started finishes even if the client goes away.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), a.cfg.ResendTimeout)
	defer cancel()
	rep, err := a.cfg.Resend(ctx, req.Filter, opts)
	fields := watermill.LogFields{
		"remote": r.RemoteAddr, "mode": string(opts.Mode), "dry_run": opts.DryRun,
		"matched": rep.Matched, "sent": rep.Sent, "failed": rep.Failed, "skipped": rep.Skipped,
	}
	if err != nil {
		a.cfg.Logger.Error("audit API: resend", err, fields)
		code := http.StatusInternalServerError
		switch {
		case errors.Is(err, audit.ErrEmptyFilter) || errors.Is(err, audit.ErrInvalidFilter) || errors.Is(err, audit.ErrBroadResend):
			code = http.StatusBadRequest
		case errors.Is(err, audit.ErrCountMismatch):
			code = http.StatusConflict
		}
		writeJSON(w, code, resendErrorResponse{Error: err.Error(), Report: rep})
		return
	}
	a.cfg.Logger.Info("audit API: resend", fields)
	writeJSON(w, http.StatusOK, rep)
}
