package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/rabbitretry/rabbitretry/audit"
)

func TestMigrationsEmbedded(t *testing.T) {
	migs, err := loadMigrations()
	if err != nil {
		t.Fatal(err)
	}
	if len(migs) == 0 || migs[0].Version != 1 || migs[0].Name != "0001_init.sql" {
		t.Fatalf("migrations = %+v, want 0001_init.sql first", migs)
	}
}

// Migrate twice: the second run applies nothing and changes nothing.
func TestMigrateIdempotent(t *testing.T) {
	pool := testPool(t)
	schema := testSchema(t, pool)
	ctx := context.Background()
	v, err := SchemaVersion(ctx, pool, schema)
	if err != nil || v != 0 {
		t.Fatalf("SchemaVersion before = %d, %v; want 0", v, err)
	}
	applied, err := Migrate(ctx, pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	migs, _ := loadMigrations()
	if len(applied) != len(migs) {
		t.Fatalf("first Migrate applied %v, want all %d", applied, len(migs))
	}
	applied, err = Migrate(ctx, pool, schema)
	if err != nil || len(applied) != 0 {
		t.Fatalf("second Migrate applied %v, %v; want none", applied, err)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+qualify(schema, migrationsTable)).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != len(migs) {
		t.Fatalf("%s has %d rows, want %d", migrationsTable, rows, len(migs))
	}
	if v, _ := SchemaVersion(ctx, pool, schema); v != migs[len(migs)-1].Version {
		t.Fatalf("SchemaVersion = %d, want %d", v, migs[len(migs)-1].Version)
	}
}

// Several processes (here goroutines with their own connections) migrating
// the same fresh schema at once: every migration is applied exactly once,
// none of them fails.
func TestMigrateConcurrent(t *testing.T) {
	pool := testPool(t)
	schema := testSchema(t, pool)
	ctx := context.Background()
	const n = 4
	var wg sync.WaitGroup
	results := make([][]int, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = Migrate(ctx, pool, schema)
		}()
	}
	wg.Wait()
	total := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("Migrate %d: %v", i, errs[i])
		}
		total += len(results[i])
	}
	migs, _ := loadMigrations()
	if total != len(migs) {
		t.Fatalf("migrations applied %d times in all (%v), want %d", total, results, len(migs))
	}
	// The schema works.
	s, err := New(ctx, Config{Pool: pool, Schema: schema, SkipMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Search(ctx, Filter0()); err != nil {
		t.Fatal(err)
	}
}

func TestNewSkipMigrateRefusesOldSchema(t *testing.T) {
	pool := testPool(t)
	schema := testSchema(t, pool)
	_, err := New(context.Background(), Config{Pool: pool, Schema: schema, SkipMigrate: true})
	if err == nil || !strings.Contains(err.Error(), "at migration 0") {
		t.Fatalf("New(SkipMigrate) on an empty schema: %v, want 'at migration 0'", err)
	}
}

func TestConfigValidate(t *testing.T) {
	pool := testPool(t)
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "Config.DSN or Config.Pool is required"},
		{Config{DSN: "postgres://x@127.0.0.1/db", Pool: pool}, "not both"},
		{Config{DSN: "postgres://x@127.0.0.1:notaport/db"}, "Config.DSN"},
		{Config{Pool: pool, Schema: "bad-name"}, "Config.Schema"},
		{Config{Pool: pool, Schema: `x"; DROP TABLE y; --`}, "Config.Schema"},
		{Config{Pool: pool, Schema: strings.Repeat("a", 64)}, "Config.Schema"},
		{Config{Pool: pool, ConnectTimeout: -1}, "Config.ConnectTimeout"},
	} {
		err := c.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Validate(%+v) = %v, want an error naming %q", c.cfg, err, c.want)
		}
		if _, err := New(context.Background(), c.cfg); err == nil {
			t.Errorf("New(%+v) succeeded", c.cfg)
		}
	}
	if err := (Config{Pool: pool}).Validate(); err != nil {
		t.Errorf("Validate(valid) = %v", err)
	}
}

// New on a DSN owns its pool: Close closes it.
func TestNewDSN(t *testing.T) {
	pool := testPool(t)
	schema := testSchema(t, pool)
	s, err := New(context.Background(), Config{DSN: PGDSNForTest(t), Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if s.Schema() != schema {
		t.Fatalf("Schema() = %q", s.Schema())
	}
	s.Close()
	if err := s.Pool().Ping(context.Background()); err == nil {
		t.Fatal("pool still usable after Close")
	}
	s.Close() // twice is fine
}

// Without pg_trgm (not installable: here a migration naming an extension
// that does not exist, as a role without the privilege would see it) the
// migration still succeeds, without the trigram index, and ErrorContains
// still works (by scanning).
func TestMigrateWithoutTrigram(t *testing.T) {
	pool := testPool(t)
	schema := testSchema(t, pool)
	ctx := context.Background()
	migs, err := loadMigrations()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(migs[0].SQL, "'pg_trgm'") || !strings.Contains(migs[0].SQL, "EXTENSION IF NOT EXISTS pg_trgm") {
		t.Fatal("0001_init.sql no longer names pg_trgm as this test expects")
	}
	migs[0].SQL = strings.NewReplacer("'pg_trgm'", "'rabbitretry_no_such_ext'",
		"EXTENSION IF NOT EXISTS pg_trgm", "EXTENSION IF NOT EXISTS rabbitretry_no_such_ext").Replace(migs[0].SQL)
	if _, err := migrate(ctx, pool, schema, migs); err != nil {
		t.Fatalf("migration without the extension failed: %v", err)
	}
	s, err := New(ctx, Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.Stats(ctx)
	if err != nil || st.TrigramIndex {
		t.Fatalf("Stats = %+v, %v; want no trigram index", st, err)
	}
	a := attempt("m", 1, t0, audit.OutcomeRetry)
	a.Error = "Upstream TIMEOUT after 5s"
	if err := s.Write(ctx, nil, []audit.Attempt{a}); err != nil {
		t.Fatal(err)
	}
	got, err := s.Search(ctx, audit.Filter{ErrorContains: "timeout"})
	if err != nil || len(got) != 1 {
		t.Fatalf("ErrorContains without index: %v, %v", ids(got), err)
	}
}

// A store at migration 1 with records is upgraded in place: 0002 keys the
// existing arrivals (an id-less one under its record ID).
func TestMigrateUpgradeFrom1(t *testing.T) {
	pool := testPool(t)
	schema := testSchema(t, pool)
	ctx := context.Background()
	migs, err := loadMigrations()
	if err != nil {
		t.Fatal(err)
	}
	if applied, err := migrate(ctx, pool, schema, migs[:1]); err != nil || len(applied) != 1 {
		t.Fatalf("migrate to 1: %v %v", applied, err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+qualify(schema, "arrivals")+` (id, message_id, exchange, routing_key, arrived_at, body, body_size)
		VALUES ('r1', 'm1', 'ex', 'rk', $1, '\x01', 1), ('r2', '', 'ex', 'rk', $1, '\x02', 1)`, t0); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+qualify(schema, "messages")+` (message_id, first_arrival_at) VALUES ('m1', $1), ('r2', $1)`, t0); err != nil {
		t.Fatal(err)
	}
	applied, err := Migrate(ctx, pool, schema)
	if err != nil || len(applied) != len(migs)-1 || applied[0] != 2 {
		t.Fatalf("upgrade applied %v, %v; want 2..", applied, err)
	}
	s, err := New(ctx, Config{Pool: pool, Schema: schema, SkipMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	for key, body := range map[string]byte{"m1": 1, "r2": 2} {
		m, ok, err := s.Get(ctx, key)
		if err != nil || !ok || m.Arrival == nil || len(m.Arrival.Body) != 1 || m.Arrival.Body[0] != body {
			t.Fatalf("Get(%s) after upgrade = %+v %v %v", key, m, ok, err)
		}
	}
}

// A schema some newer binary migrated (a migration this one does not know)
// is refused by Migrate, New and New with SkipMigrate, naming both
// versions, and changed by none of them (issue 19 item 13).
func TestSchemaNewerThanBinaryRefused(t *testing.T) {
	pool := testPool(t)
	schema := testSchema(t, pool)
	ctx := context.Background()
	if _, err := Migrate(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	migs, _ := loadMigrations()
	newer := migs[len(migs)-1].Version + 7
	if _, err := pool.Exec(ctx, `INSERT INTO `+schema+`.`+migrationsTable+` (version, name) VALUES ($1, 'from_the_future.sql')`, newer); err != nil {
		t.Fatal(err)
	}
	_, errMigrate := Migrate(ctx, pool, schema)
	_, errNew := New(ctx, Config{Pool: pool, Schema: schema})
	_, errSkip := New(ctx, Config{Pool: pool, Schema: schema, SkipMigrate: true})
	for name, err := range map[string]error{"Migrate": errMigrate, "New": errNew, "New SkipMigrate": errSkip} {
		if !errors.Is(err, ErrSchemaTooNew) || !strings.Contains(fmt.Sprint(err), strconv.Itoa(newer)) {
			t.Errorf("%s: %v, want ErrSchemaTooNew naming version %d", name, err, newer)
		}
	}
	if v, err := SchemaVersion(ctx, pool, schema); err != nil || v != newer {
		t.Errorf("SchemaVersion = %d, %v; want %d, unchanged", v, err, newer)
	}
}
