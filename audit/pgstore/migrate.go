package pgstore

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// schemaMigration is one versioned schema change, embedded from
// migrations/NNNN_name.sql.
type schemaMigration struct {
	// Version is the file name's numeric prefix (1 for 0001_init.sql).
	Version int
	// Name is the file name.
	Name string
	// SQL is the file's text.
	SQL string
}

// migrationsTable is the table, in the store's schema, that records the
// applied migrations: (version integer primary key, name text, applied_at
// timestamptz).
const migrationsTable = "rabbitretry_audit_schema_migrations"

// ErrSchemaTooNew is wrapped by the error of Migrate and New when the
// schema has a migration this binary does not know (a newer release
// migrated it): the binary would read and write tables it does not
// understand. Run the newer release, or a binary at least as new.
var ErrSchemaTooNew = errors.New("pgstore: the schema is newer than this binary")

// loadMigrations returns the embedded migrations in version order.
func loadMigrations() ([]schemaMigration, error) {
	entries, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		return nil, fmt.Errorf("pgstore: read embedded migrations: %w", err)
	}
	var out []schemaMigration
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".sql") {
			continue
		}
		prefix, _, ok := strings.Cut(name, "_")
		if !ok {
			return nil, fmt.Errorf("pgstore: migration %q: want NNNN_name.sql", name)
		}
		v, err := strconv.Atoi(prefix)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("pgstore: migration %q: bad version %q", name, prefix)
		}
		b, err := migrationFS.ReadFile("migrations/" + name)
		if err != nil {
			return nil, fmt.Errorf("pgstore: read migration %q: %w", name, err)
		}
		out = append(out, schemaMigration{Version: v, Name: name, SQL: string(b)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i := 1; i < len(out); i++ {
		if out[i].Version == out[i-1].Version {
			return nil, fmt.Errorf("pgstore: migrations %q and %q share version %d", out[i-1].Name, out[i].Name, out[i].Version)
		}
	}
	return out, nil
}

// Migrate creates schema ("rabbitretry_audit" if empty) if it is missing and
// applies the embedded migrations it does not have yet, in version order,
// each in its own transaction together with its row in migrationsTable.
// Each transaction first takes pg_advisory_xact_lock on a key derived from
// the schema name, so processes migrating the same schema at once apply
// each migration exactly once (the others wait, then see it applied).
// It returns the versions it applied (none when the schema was current).
//
// Errors: an invalid schema name; ErrSchemaTooNew (the schema has a
// migration newer than the last embedded one; nothing is applied); a
// failed migration (its transaction is rolled back, earlier ones stay
// applied; the error names the file).
//
// The role needs CREATE on the database (to create the schema) or an
// existing schema it may create tables in. The pg_trgm extension is
// optional: without the privilege to create it, 0001 skips its index.
func Migrate(ctx context.Context, pool *pgxpool.Pool, schema string) ([]int, error) {
	if pool == nil {
		return nil, fmt.Errorf("pgstore: Migrate: pool is nil")
	}
	if schema == "" {
		schema = defaultSchema
	}
	if err := validSchema(schema); err != nil {
		return nil, err
	}
	migs, err := loadMigrations()
	if err != nil {
		return nil, err
	}
	if err := checkNotNewer(ctx, pool, schema, migs); err != nil {
		return nil, err
	}
	return migrate(ctx, pool, schema, migs)
}

// checkNotNewer returns ErrSchemaTooNew (wrapped, naming both versions)
// if schema has a migration above the last of migs.
func checkNotNewer(ctx context.Context, pool *pgxpool.Pool, schema string, migs []schemaMigration) error {
	v, err := SchemaVersion(ctx, pool, schema)
	if err != nil {
		return err
	}
	if known := migs[len(migs)-1].Version; v > known {
		return fmt.Errorf("%w: schema %s is at migration %d, this binary knows migrations up to %d", ErrSchemaTooNew, schema, v, known)
	}
	return nil
}

func migrate(ctx context.Context, pool *pgxpool.Pool, schema string, migs []schemaMigration) ([]int, error) {
	var applied []int
	for _, m := range migs {
		did, err := applyOne(ctx, pool, schema, m)
		if err != nil {
			return applied, err
		}
		if did {
			applied = append(applied, m.Version)
		}
	}
	return applied, nil
}

func applyOne(ctx context.Context, pool *pgxpool.Pool, schema string, m schemaMigration) (bool, error) {
	q := pgx.Identifier{schema}.Sanitize()
	did := false
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('rabbitretry_audit:migrate:' || $1))`, schema); err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+q); err != nil {
			return fmt.Errorf("create schema: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+q+`.`+migrationsTable+` (
			version integer PRIMARY KEY,
			name text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return fmt.Errorf("create %s: %w", migrationsTable, err)
		}
		var n int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM `+q+`.`+migrationsTable+` WHERE version = $1`, m.Version).Scan(&n); err != nil {
			return fmt.Errorf("read %s: %w", migrationsTable, err)
		}
		if n > 0 {
			return nil
		}
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+q); err != nil {
			return fmt.Errorf("set search_path: %w", err)
		}
		if _, err := tx.Exec(ctx, m.SQL); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+q+`.`+migrationsTable+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
			return fmt.Errorf("record: %w", err)
		}
		did = true
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("pgstore: migration %s (schema %s): %w", m.Name, schema, err)
	}
	return did, nil
}
