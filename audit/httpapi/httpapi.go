// Package httpapi serves the message audit (package audit) over HTTP as
// JSON: search, one message's story, store statistics and, only when
// explicitly enabled and authorised, resend.
//
// Routes (net/http pattern routing, Go 1.22+):
//
//	GET  /v1/messages?<filter>   {"messages": [...], "next": "<cursor>"}
//	                             (GET routes: open, or with Config.ReadToken
//	                             a bearer token like resend's)
//	GET  /v1/messages/{id}       one audit.Message (404 if unknown)
//	GET  /v1/stats               Config.Stats's value (404 without it)
//	POST /v1/resend              audit.ResendReport; 404 unless
//	                             Config.EnableResend, 401 without
//	                             "Authorization: Bearer <token>", 403
//	                             with a wrong token, 409 while another
//	                             resend runs
//
// Filter parameters of /v1/messages (all optional, all must match; see
// audit.Filter): message_id, correlation_id, from, to (RFC 3339), queue,
// exchange, routing_key, outcome, last_outcome, error_class,
// error_contains, header=key=value (repeatable; the value is parsed as JSON
// when it is JSON, else taken as a string: header=tenant=acme,
// header=priority=5), limit (1..10000, default 100), after (the "next"
// cursor of the previous page). An unknown parameter or a bad value is a
// 400 with {"error": "..."} naming it: a typo never widens a search.
//
// Search results carry no message bodies ("body": null; body_size and
// body_truncated say what there is): GET /v1/messages/{id} has the body,
// base64 in the JSON (encoding/json's form of []byte). The search response
// is streamed, message by message, so its memory stays bounded whatever
// limit= and the bodies' size (with pgstore: one chunk of 100 messages'
// headers and attempts). Durations are integer nanoseconds
// (audit.Attempt's *_ns fields).
//
// POST /v1/resend takes {"filter": audit.Filter, "mode": "to-queue" |
// "to-exchange", "queue": "...", "dry_run": true, "limit": n, "allow_all":
// false, "expected_count": n} (unknown fields are a 400) and runs
// audit.Resender.Resend, which refuses, with a 400 and nothing sent, an
// empty filter or a broad result (more than the Resender's ConfirmAbove
// messages, 10 by default, or every message of the audit, whatever fields
// the filter sets) without allow_all. allow_all (unless dry_run) needs
// expected_count, the "matched" of a dry run of the same request: a
// different count is a 409 and nothing is sent. One resend runs at a time (a
// second request meanwhile gets 409 Conflict). A resend that started runs to
// its end even if the client goes away (bounded by Config.ResendTimeout),
// and is logged with its totals. A resend that stopped part-way (a lost
// connection, a confirm timeout) is a 500 with {"error": "...", "report":
// audit.ResendReport}: what was sent until then.
package httpapi

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
)

// maxLimit is the largest limit= (and filter.limit of a resend), as
// pgstore's; without limit= a page has 100 messages (pgstore's default).
const maxLimit = auditconst.MaxSearchLimit

// defaultResendTimeout bounds one POST /v1/resend.
const defaultResendTimeout = auditconst.ResendTimeout

// maxBodyBytes bounds a POST body.
const maxBodyBytes = 1 << 20

// Store is what the API reads: an audit.Store that pages and finds one
// message. Implemented by *pgstore.Store, whose SearchEach (used when the
// Store has it) streams search results without loading bodies.
type Store interface {
	audit.Store
	// SearchPage is Search that also returns the cursor of the next page
	// ("" on the last page).
	SearchPage(ctx context.Context, f audit.Filter) ([]audit.Message, string, error)
	// Get returns one message's story; false if unknown.
	Get(ctx context.Context, messageID string) (audit.Message, bool, error)
}

// Config configures the API handler.
type Config struct {
	// Store is searched. Required.
	Store Store
	// Stats, when set, answers GET /v1/stats with its value as JSON (e.g.
	// pgstore.Store.Stats); without it the route is a 404.
	Stats func(ctx context.Context) (any, error)
	// EnableResend registers POST /v1/resend. Default false: the API is
	// read-only and the route is a 404.
	EnableResend bool
	// ResendToken is the bearer token POST /v1/resend requires
	// ("Authorization: Bearer <token>"), compared in constant time.
	// Required (at least 16 bytes) with EnableResend.
	ResendToken string
	// ReadToken, when set, makes the GET routes require "Authorization:
	// Bearer <ReadToken>" (or the ResendToken) too: message bodies and
	// headers may hold personal data. At least 16 bytes. Default "": reads
	// are open to whoever reaches the listener (auditctl serve listens on
	// 127.0.0.1 by default).
	ReadToken string
	// Resend performs resends: an *audit.Resender's Resend method
	// (Resend: resender.Resend). Required with EnableResend.
	Resend func(ctx context.Context, f audit.Filter, opts audit.ResendOptions) (audit.ResendReport, error)
	// ResendTimeout bounds one resend (default 5 min).
	ResendTimeout time.Duration
	// Logger logs resends and internal errors. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.ResendTimeout == 0 {
		c.ResendTimeout = defaultResendTimeout
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first invalid field: Store nil; with EnableResend,
// ResendToken shorter than 16 bytes or Resend nil; a ReadToken shorter
// than 16 bytes; ResendTimeout negative.
func (c Config) Validate() error {
	c.setDefaults()
	switch {
	case c.Store == nil:
		return errors.New("httpapi: Config.Store is required")
	case c.EnableResend && c.ResendToken == "":
		return errors.New("httpapi: Config.ResendToken is required with Config.EnableResend (resend must never be open to anyone who can reach the port)")
	case c.EnableResend && len(c.ResendToken) < 16:
		return errors.New("httpapi: Config.ResendToken is shorter than 16 bytes")
	case c.EnableResend && c.Resend == nil:
		return errors.New("httpapi: Config.Resend is required with Config.EnableResend")
	case c.ReadToken != "" && len(c.ReadToken) < 16:
		return errors.New("httpapi: Config.ReadToken is shorter than 16 bytes")
	case c.ResendTimeout < 0:
		return fmt.Errorf("httpapi: Config.ResendTimeout %v is negative", c.ResendTimeout)
	}
	return nil
}

type api struct {
	cfg       Config
	resending sync.Mutex // one resend at a time
	tokenHash [32]byte   // of ResendToken
	readHash  [32]byte   // of ReadToken
}

// New validates cfg and returns the API handler.
func New(cfg Config) (http.Handler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	a := &api{cfg: cfg, tokenHash: sha256.Sum256([]byte(cfg.ResendToken)), readHash: sha256.Sum256([]byte(cfg.ReadToken))}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/messages", a.reader(a.search))
	mux.HandleFunc("GET /v1/messages/{id}", a.reader(a.get))
	if cfg.Stats != nil {
		mux.HandleFunc("GET /v1/stats", a.reader(a.stats))
	}
	if cfg.EnableResend {
		mux.HandleFunc("POST /v1/resend", a.resend)
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "no such route: "+r.Method+" "+r.URL.Path)
	})
	return mux, nil
}

type errorBody struct {
	Error string `json:"error"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, errorBody{Error: msg})
}

// storeError answers a Store error: a 400 with the error's own text for
// one wrapping audit.ErrInvalidFilter (the request's mistake); else a 500
// that says only what failed, the error (the database's text) going to the
// log alone.
func (a *api) storeError(w http.ResponseWriter, what string, err error) {
	if errors.Is(err, audit.ErrInvalidFilter) {
		writeError(w, http.StatusBadRequest, invalidFilterText(err))
		return
	}
	a.cfg.Logger.Error("audit API: "+what, err, nil)
	writeError(w, http.StatusInternalServerError, what+" failed: internal error (the server log has the details)")
}

// eachStore is the optional Store capability search streams with
// (pgstore.Store.SearchEach): messages one by one, without bodies.
type eachStore interface {
	SearchEach(ctx context.Context, f audit.Filter, fn func(audit.Message) error) (string, error)
}

// search streams the page: each message is encoded and written as the
// store hands it over, without its body (Arrival.Body null: GET
// /v1/messages/{id} has it), so memory stays bounded whatever limit= and
// the bodies' size. An error before the first message is a 400/500; one
// after it aborts the response (the client sees it cut, never a page that
// looks complete) and is logged.
func (a *api) search(w http.ResponseWriter, r *http.Request) {
	f, err := parseFilter(r.URL.Query())
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	each := func(ctx context.Context, f audit.Filter, fn func(audit.Message) error) (string, error) {
		if s, ok := a.cfg.Store.(eachStore); ok {
			return s.SearchEach(ctx, f, fn)
		}
		msgs, next, err := a.cfg.Store.SearchPage(ctx, f)
		if err != nil {
			return "", err
		}
		for _, m := range msgs {
			if err := fn(m); err != nil {
				return "", err
			}
		}
		return next, nil
	}
	started := false
	start := func() {
		started = true
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, `{"messages": [`)
	}
	var writeErr error
	next, err := each(r.Context(), f, func(m audit.Message) error {
		sep := ",\n  "
		if !started {
			start()
			sep = "\n  "
		}
		if m.Arrival != nil && m.Arrival.Body != nil {
			arr := *m.Arrival // a store without SearchEach: leave its body out
			arr.Body = nil
			m.Arrival = &arr
		}
		b, err := json.Marshal(m)
		if err != nil {
			return err
		}
		if _, writeErr = io.WriteString(w, sep); writeErr == nil {
			_, writeErr = w.Write(b)
		}
		return writeErr
	})
	switch {
	case err != nil && !started:
		a.storeError(w, "search", err)
		return
	case err != nil:
		if writeErr == nil { // the client's going away is not worth a log line
			a.cfg.Logger.Error("audit API: search (response cut)", err, nil)
		}
		panic(http.ErrAbortHandler)
	}
	if !started {
		start()
	}
	tail := "\n]"
	if next != "" {
		nb, _ := json.Marshal(next)
		tail += `, "next": ` + string(nb)
	}
	_, _ = io.WriteString(w, tail+"}\n")
}

func (a *api) get(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if err := (audit.Filter{MessageID: id}).Validate(); err != nil {
		writeError(w, http.StatusBadRequest, invalidFilterText(err))
		return
	}
	m, ok, err := a.cfg.Store.Get(r.Context(), id)
	if err != nil {
		a.storeError(w, "get", err)
		return
	}
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no audit record of message %q", id))
		return
	}
	writeJSON(w, http.StatusOK, m)
}

func (a *api) stats(w http.ResponseWriter, r *http.Request) {
	s, err := a.cfg.Stats(r.Context())
	if err != nil {
		a.storeError(w, "stats", err)
		return
	}
	writeJSON(w, http.StatusOK, s)
}

// reader wraps a GET handler with the ReadToken check, when one is set.
func (a *api) reader(h http.HandlerFunc) http.HandlerFunc {
	if a.cfg.ReadToken == "" {
		return h
	}
	return func(w http.ResponseWriter, r *http.Request) {
		if a.checkToken(w, r, "reading", a.readHash, a.tokenHash) {
			h(w, r)
		}
	}
}

// authorized checks the resend bearer token: 401 without one, 403 if
// wrong.
func (a *api) authorized(w http.ResponseWriter, r *http.Request) bool {
	return a.checkToken(w, r, "resend", a.tokenHash)
}

// checkToken accepts a bearer token whose SHA-256 is one of hashes (a
// constant-time comparison, in the length too); else 401 (no bearer token)
// or 403 (another one).
func (a *api) checkToken(w http.ResponseWriter, r *http.Request, what string, hashes ...[32]byte) bool {
	h := r.Header.Get("Authorization")
	scheme, tok, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || strings.TrimSpace(tok) == "" {
		w.Header().Set("WWW-Authenticate", `Bearer realm="rabbitretry-audit"`)
		writeError(w, http.StatusUnauthorized, what+" needs Authorization: Bearer <token>")
		return false
	}
	got := sha256.Sum256([]byte(strings.TrimSpace(tok)))
	match := 0
	for _, want := range hashes {
		match |= subtle.ConstantTimeCompare(got[:], want[:])
	}
	if match != 1 {
		writeError(w, http.StatusForbidden, "wrong token for "+what)
		return false
	}
	return true
}
