// Package pgstore is the PostgreSQL audit.Store: it writes Arrival and
// Attempt records idempotently, finds messages by any audit.Filter field
// with keyset pagination, and prunes old records in short batches. It uses
// github.com/jackc/pgx/v5 (pgxpool) and PostgreSQL 12 or later.
//
// # Schema
//
// Everything lives in one schema (Config.Schema, default
// "rabbitretry_audit"), created if missing. Versioned migrations are
// embedded (migrations/0001_init.sql, ...) and applied by Migrate (New runs
// it unless Config.SkipMigrate), each in a transaction under a
// pg_advisory_xact_lock, recorded in rabbitretry_audit_schema_migrations
// (version, name, applied_at).
//
//	arrivals   one row per message published to an audited exchange
//	  id text PK (Arrival.ID), message_id, correlation_id, exchange,
//	  routing_key, published_at timestamptz NULL, arrived_at timestamptz,
//	  headers jsonb, properties jsonb, body bytea (byte-exact),
//	  body_size int, body_truncated bool, recorded_at timestamptz,
//	  message_key text (generated: message_id, or id when message_id = '')
//	attempts   one row per attempt of the retry chain
//	  id text PK (Attempt.ID), message_id, correlation_id, queue,
//	  attempt int, started_at timestamptz, duration_us bigint,
//	  outcome text, delay_ms bigint, tier_ms bigint, error_class text,
//	  error text, recorded_at timestamptz
//	messages   one row per message id, kept by Write in the same transaction
//	  message_id PK, first_arrival_at, first_started_at,
//	  message_time = COALESCE(first_arrival_at, first_started_at) (stored),
//	  last_attempt, last_started_at, last_attempt_id, last_outcome
//
// A message is all the records with its message id. An arrival without a
// message id (published with neither a UUID header nor a message-id
// property) is a message of its own, listed under its record ID
// (Message.MessageID = Arrival.ID, Arrival.MessageID = "").
//
// Indexes: messages (message_time, message_id) for the newest-first keyset
// pages and From/To, messages (last_outcome, message_time); arrivals
// (message_key, arrived_at), attempts (message_id, started_at);
// correlation_id on both; arrivals arrived_at,
// (exchange, routing_key), GIN (headers jsonb_path_ops) for Headers
// (headers @> $1); attempts started_at, (queue, started_at),
// (outcome, error_class), error_class; and, when the pg_trgm extension is
// installed or the role may create it, a trigram GIN index on attempts.error
// for ErrorContains (ILIKE); without it ErrorContains scans the attempts
// the other conditions leave (the migration never fails for want of it).
//
// Measured on a 2-core machine shared with other test runs (PostgreSQL 15,
// load average 1-6; TestWriteThroughput, BenchmarkWrite500,
// TestSearchLatencyLarge): Write of batches of 500 records (one arrival with
// a 512-byte body per two attempts) 30,000-50,000 records/s, 10-17 ms a
// batch (COPY into a temporary table then INSERT ... SELECT: 33,000-42,000;
// one INSERT per row in a pgx.Batch: 28,000-37,000); on 200,000 messages
// (600,000 records) the first page of 100 for any single Filter field in
// 1-100 ms; Prune of 300,000 records in 4-9 s, 81 statements of at most
// 5,000 rows.
//
// Times are stored with PostgreSQL's microsecond resolution; Attempt
// Duration in whole microseconds, Delay and Tier in whole milliseconds.
// Text that PostgreSQL cannot hold (NUL bytes, invalid UTF-8) is stored
// with U+FFFD in their place, so a record is never refused for its content.
package pgstore

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// defaultSchema is the schema used when Config.Schema is empty.
const defaultSchema = auditconst.Schema

// Search limits.
const (
	// defaultLimit is the number of messages Search returns when
	// Filter.Limit is 0.
	defaultLimit = 100
	// maxLimit is the largest Filter.Limit Search accepts.
	maxLimit = auditconst.MaxSearchLimit
)

// defaultPruneBatch is the number of rows Prune deletes per statement when
// its batch argument is 0 or less.
const defaultPruneBatch = auditconst.PruneBatch

// Config configures a Store. Exactly one of DSN and Pool is set.
type Config struct {
	// DSN is a PostgreSQL connection string (URL or key=value), e.g.
	// "postgres://postgres@127.0.0.1:5432/test?sslmode=disable". New opens
	// a pgxpool.Pool on it, which Close closes.
	DSN string
	// Pool is an existing pool to use instead of DSN; Close leaves it open.
	Pool *pgxpool.Pool
	// Schema holds the store's tables (default "rabbitretry_audit"); it is
	// created if missing. Letters, digits and '_', not starting with a
	// digit, at most 63 bytes.
	Schema string
	// SkipMigrate makes New not run Migrate (when migrations are applied
	// by a deploy step instead); New then fails if the schema is not at
	// the latest version.
	SkipMigrate bool
	// ConnectTimeout bounds New's first connection and migration
	// (default 30 s).
	ConnectTimeout time.Duration
}

func (c *Config) setDefaults() {
	if c.Schema == "" {
		c.Schema = defaultSchema
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 30 * time.Second
	}
}

var schemaRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

func validSchema(s string) error {
	if !schemaRe.MatchString(s) {
		return fmt.Errorf("pgstore: Config.Schema %q: want letters, digits and '_', not starting with a digit, at most 63 bytes", s)
	}
	return nil
}

// Validate reports the first invalid field (after defaults are filled in).
func (c Config) Validate() error {
	c.setDefaults()
	switch {
	case c.DSN == "" && c.Pool == nil:
		return errors.New("pgstore: Config.DSN or Config.Pool is required")
	case c.DSN != "" && c.Pool != nil:
		return errors.New("pgstore: set one of Config.DSN and Config.Pool, not both")
	case c.ConnectTimeout < 0:
		return fmt.Errorf("pgstore: Config.ConnectTimeout %v is negative", c.ConnectTimeout)
	}
	if c.DSN != "" {
		if _, err := pgxpool.ParseConfig(c.DSN); err != nil {
			return fmt.Errorf("pgstore: Config.DSN: %w", redact.Error(err, c.DSN))
		}
	}
	return validSchema(c.Schema)
}

// Store is the PostgreSQL audit.Store. It is safe for concurrent use. It
// keeps a delivery log (table unacked_arrivals), through which the
// audit.Consumer stores an arrival redelivered after a crash between commit
// and ack exactly once (see audit.Arrival.ID).
type Store struct {
	logOffer
	pool    *pgxpool.Pool
	ownPool bool
	schema  string
	q       queries
}

var _ audit.Store = (*Store)(nil)

// New validates cfg, connects (DSN) and, unless cfg.SkipMigrate, applies
// the missing migrations (Migrate). Errors: Validate's; the connection's
// (unreachable server, authentication) within ConnectTimeout; Migrate's;
// with SkipMigrate, a schema not at the latest migration; ErrSchemaTooNew
// (with or without SkipMigrate) for a schema a newer release migrated.
func New(ctx context.Context, cfg Config) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	cctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	s := &Store{pool: cfg.Pool, schema: cfg.Schema}
	s.logOffer = deliverylog.NewOffer[audit.Arrival, audit.Attempt]((*deliveryLog)(s))
	if s.pool == nil {
		pool, err := pgxpool.New(cctx, cfg.DSN)
		if err != nil {
			return nil, fmt.Errorf("pgstore: connect: %w", redact.Error(err, cfg.DSN))
		}
		s.pool, s.ownPool = pool, true
	}
	fail := func(err error) (*Store, error) {
		s.Close()
		return nil, err
	}
	if err := s.pool.Ping(cctx); err != nil {
		return fail(fmt.Errorf("pgstore: connect: %w", redact.Error(err, cfg.DSN)))
	}
	if cfg.SkipMigrate {
		migs, err := loadMigrations()
		if err != nil {
			return fail(err)
		}
		if err := checkNotNewer(cctx, s.pool, cfg.Schema, migs); err != nil {
			return fail(err)
		}
		v, err := SchemaVersion(cctx, s.pool, cfg.Schema)
		if err != nil {
			return fail(err)
		}
		if want := migs[len(migs)-1].Version; v < want {
			return fail(fmt.Errorf("pgstore: schema %s is at migration %d, want %d (run Migrate, or unset Config.SkipMigrate)", cfg.Schema, v, want))
		}
	} else if _, err := Migrate(cctx, s.pool, cfg.Schema); err != nil {
		return fail(err)
	}
	s.q = buildQueries(cfg.Schema)
	return s, nil
}

// SchemaVersion returns the highest migration version applied to schema,
// 0 if none (or the schema does not exist).
func SchemaVersion(ctx context.Context, pool *pgxpool.Pool, schema string) (int, error) {
	if err := validSchema(schema); err != nil {
		return 0, err
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, qualify(schema, migrationsTable)).Scan(&exists); err != nil {
		return 0, fmt.Errorf("pgstore: schema version: %w", err)
	}
	if !exists {
		return 0, nil
	}
	var v int
	if err := pool.QueryRow(ctx, `SELECT COALESCE(max(version), 0) FROM `+qualify(schema, migrationsTable)).Scan(&v); err != nil {
		return 0, fmt.Errorf("pgstore: schema version: %w", err)
	}
	return v, nil
}

// Pool returns the store's connection pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Schema returns the store's schema name.
func (s *Store) Schema() string { return s.schema }

// Close closes the pool if New opened it (Config.DSN); a Config.Pool is
// left open. Safe to call more than once.
func (s *Store) Close() {
	if s.ownPool && s.pool != nil {
		s.pool.Close()
	}
}
