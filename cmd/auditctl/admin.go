package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/httpapi"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
)

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

func cmdPrune(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	before := e.now.Add(-e.o.olderThan)
	start := time.Now()
	res, err := st.Prune(e.ctx, before, e.o.batch)
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
		cfg.EnableResend, cfg.ResendToken, cfg.Resend = true, os.Getenv(tokenEnv), r.Resend
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
