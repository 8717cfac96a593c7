package pgstore

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// PruneResult counts what Prune deleted.
type PruneResult struct {
	// Arrivals and Attempts are the records deleted; Messages the message
	// rows left with no record.
	Arrivals int64 `json:"arrivals"`
	Attempts int64 `json:"attempts"`
	Messages int64 `json:"messages"`
	// Statements is the number of DELETE statements run (each its own
	// short transaction of at most batch rows).
	Statements int `json:"statements"`
}

// Prune deletes the arrivals that arrived before olderThan and the attempts
// that started before it, batch rows per DELETE (5,000 when
// batch <= 0), each statement its own transaction, looping until none is
// left, so neither table is locked for long and writers keep going. It
// returns the records deleted per table (their total is
// Arrivals + Attempts). A message whose arrival is pruned but whose
// later attempts are not keeps its attempts: Search then shows it without
// arrival, timed by its first remaining attempt. Prune runs alongside Write: a record written while Prune runs
// is either pruned or stays findable (a message row Prune deletes under a
// concurrent Write is put back in the same transaction). Errors: the database's, after which the batches already
// deleted stay deleted and Prune can simply be run again.
func (s *Store) Prune(ctx context.Context, olderThan time.Time, batch int) (PruneResult, error) {
	var r PruneResult
	if batch <= 0 {
		batch = defaultPruneBatch
	}
	loop := func(what, sql string, n *int64) error {
		for {
			tag, err := s.pool.Exec(ctx, sql, olderThan, batch)
			if err != nil {
				return fmt.Errorf("pgstore: prune %s: %w", what, err)
			}
			r.Statements++
			*n += tag.RowsAffected()
			if tag.RowsAffected() < int64(batch) {
				return nil
			}
		}
	}
	if err := loop("arrivals", `DELETE FROM `+s.q.arrivals+` WHERE id IN (SELECT id FROM `+s.q.arrivals+
		` WHERE arrived_at < $1 LIMIT $2)`, &r.Arrivals); err != nil {
		return r, err
	}
	if err := loop("attempts", `DELETE FROM `+s.q.attempts+` WHERE id IN (SELECT id FROM `+s.q.attempts+
		` WHERE started_at < $1 LIMIT $2)`, &r.Attempts); err != nil {
		return r, err
	}
	// The messages rows timed before the cutoff, in (message_time,
	// message_id) order, batch rows a transaction: each is deleted, then
	// rebuilt from the records it still has (a message whose arrival was
	// pruned but not its later attempts is then timed by its first
	// remaining attempt). Rows a Write holds are skipped (SKIP LOCKED: the
	// next Prune gets them), so Prune never waits for a writer and cannot
	// deadlock with one (Writes lock messages rows in key order, Prune in
	// time order). Rebuilding from a fresh snapshot in the same transaction
	// keeps a message whose record a Write committed meanwhile.
	del := `WITH c AS (SELECT message_id FROM ` + s.q.messages + `
		WHERE message_time < $1 AND (message_time, message_id) > ($2::timestamptz, $3::text)
		ORDER BY message_time, message_id LIMIT $4 FOR UPDATE SKIP LOCKED)
	DELETE FROM ` + s.q.messages + ` m USING c WHERE m.message_id = c.message_id
	RETURNING m.message_time, m.message_id`
	type key struct {
		t  time.Time
		id string
	}
	after := key{t: time.Unix(0, 0).AddDate(-3000, 0, 0)}
	for {
		var deleted []key
		var restored int64
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, del, olderThan, after.t, after.id, batch)
			if err != nil {
				return err
			}
			deleted, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (key, error) {
				var k key
				err := r.Scan(&k.t, &k.id)
				return k, err
			})
			if err != nil || len(deleted) == 0 {
				return err
			}
			ids := make([]string, len(deleted))
			for i, k := range deleted {
				ids[i] = k.id
				if k.t.After(after.t) || (k.t.Equal(after.t) && k.id > after.id) {
					after = k
				}
			}
			tag, err := tx.Exec(ctx, s.q.rebuildMessages, ids)
			restored = tag.RowsAffected()
			return err
		})
		if err != nil {
			return r, fmt.Errorf("pgstore: prune messages: %w", err)
		}
		r.Statements++
		r.Messages += int64(len(deleted)) - restored
		if len(deleted) < batch {
			break
		}
	}
	return r, nil
}

// Stats summarises the store, for operators (auditctl).
type Stats struct {
	// Arrivals, Attempts and Messages are row counts.
	Arrivals int64 `json:"arrivals"`
	Attempts int64 `json:"attempts"`
	Messages int64 `json:"messages"`
	// OldestArrival and NewestArrival bound arrived_at, OldestAttempt and
	// NewestAttempt started_at (zero when the table is empty).
	OldestArrival time.Time `json:"oldest_arrival,omitzero"`
	NewestArrival time.Time `json:"newest_arrival,omitzero"`
	OldestAttempt time.Time `json:"oldest_attempt,omitzero"`
	NewestAttempt time.Time `json:"newest_attempt,omitzero"`
	// SchemaVersion is the latest applied migration.
	SchemaVersion int `json:"schema_version"`
	// TrigramIndex reports whether ErrorContains has its pg_trgm index.
	TrigramIndex bool `json:"trigram_index"`
	// SetAside counts the records set aside (table set_aside: the store
	// rejected them for good, audit.ErrRecordRejected); SetAsideRecent are
	// the latest 10, newest first, with their reasons.
	SetAside       int64             `json:"set_aside"`
	SetAsideRecent []SetAsideSummary `json:"set_aside_recent,omitempty"`
}

// SetAsideSummary is one set_aside row without the record.
type SetAsideSummary struct {
	Kind      string    `json:"kind"`
	RecordID  string    `json:"record_id"`
	MessageID string    `json:"message_id"`
	Reason    string    `json:"reason"`
	At        time.Time `json:"set_aside_at"`
}

// Stats counts the rows (exact count(*): a full scan of each table) and
// finds the oldest and newest records (index lookups). Errors: the
// database's.
func (s *Store) Stats(ctx context.Context) (Stats, error) {
	var st Stats
	var oa, na, ot, nt *time.Time
	err := s.pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM `+s.q.arrivals+`), (SELECT count(*) FROM `+s.q.attempts+`), (SELECT count(*) FROM `+s.q.messages+`),
		(SELECT min(arrived_at) FROM `+s.q.arrivals+`), (SELECT max(arrived_at) FROM `+s.q.arrivals+`),
		(SELECT min(started_at) FROM `+s.q.attempts+`), (SELECT max(started_at) FROM `+s.q.attempts+`),
		to_regclass($1) IS NOT NULL`, qualify(s.schema, "attempts_error_trgm_idx")).
		Scan(&st.Arrivals, &st.Attempts, &st.Messages, &oa, &na, &ot, &nt, &st.TrigramIndex)
	if err != nil {
		return st, fmt.Errorf("pgstore: stats: %w", err)
	}
	for _, p := range []struct {
		src *time.Time
		dst *time.Time
	}{{oa, &st.OldestArrival}, {na, &st.NewestArrival}, {ot, &st.OldestAttempt}, {nt, &st.NewestAttempt}} {
		if p.src != nil {
			*p.dst = *p.src
		}
	}
	if st.SchemaVersion, err = SchemaVersion(ctx, s.pool, s.schema); err != nil {
		return st, err
	}
	sa := qualify(s.schema, "set_aside")
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM `+sa).Scan(&st.SetAside); err != nil {
		return st, fmt.Errorf("pgstore: stats: %w", err)
	}
	rows, err := s.pool.Query(ctx, `SELECT kind, record_id, message_id, reason, set_aside_at FROM `+sa+` ORDER BY set_aside_at DESC, id LIMIT 10`)
	if err != nil {
		return st, fmt.Errorf("pgstore: stats: %w", err)
	}
	for rows.Next() {
		var r SetAsideSummary
		if err := rows.Scan(&r.Kind, &r.RecordID, &r.MessageID, &r.Reason, &r.At); err != nil {
			rows.Close()
			return st, fmt.Errorf("pgstore: stats: %w", err)
		}
		st.SetAsideRecent = append(st.SetAsideRecent, r)
	}
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("pgstore: stats: %w", err)
	}
	return st, nil
}
