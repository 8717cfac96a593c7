package pgstore

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/wire"
)

// Write stores the records in one transaction and returns once it has
// committed. It is idempotent: arrivals and attempts whose ID is already
// stored (or repeated within the call) are skipped (INSERT ... ON CONFLICT
// (id) DO NOTHING), so a batch redelivered by RabbitMQ after a crash
// between commit and ack is written again without duplicates (the
// audit.Consumer writes through the Store's delivery log, which also
// records each arrival's delivery until its ack, so that a redelivered
// arrival keeps its ID across a crash). The rows go
// in one round trip: one INSERT ... SELECT FROM unnest(arrays) per table
// and one upsert of the messages rows, rows sorted by key so concurrent
// writers cannot deadlock.
//
// Errors: a record with an empty ID (nothing is written); a record the
// store can never take, wrapping audit.ErrRecordRejected (an indexed text
// value over maxIndexedBytes, a time outside years 1-9999, or SQLSTATE
// class 22 or 54 from PostgreSQL); the database's other errors (connection
// lost, serialization), temporary: nothing was committed and the call can
// be repeated. Content never fails a write: NUL bytes and invalid
// UTF-8 in text and header values are replaced by U+FFFD, header values
// JSON cannot encode (NaN, channels) are stored as their fmt.Sprint text.
func (s *Store) Write(ctx context.Context, arrivals []audit.Arrival, attempts []audit.Attempt) error {
	if len(arrivals) == 0 && len(attempts) == 0 {
		return nil
	}
	b, err := buildWriteBatch(s.q, arrivals, attempts)
	if err != nil {
		return err
	}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		if permanent(err) {
			return fmt.Errorf("pgstore: write %d arrivals, %d attempts: %w: %w", len(arrivals), len(attempts), audit.ErrRecordRejected, err)
		}
		return fmt.Errorf("pgstore: write %d arrivals, %d attempts: %w", len(arrivals), len(attempts), err)
	}
	return nil
}

// maxIndexedBytes bounds the indexed text values of a record (message and
// correlation ids, record ids, exchange, routing key, queue, outcome,
// error class), in bytes: a PostgreSQL btree index row must fit in a
// third of a page (about 2700 bytes; SQLSTATE 54000 "index row size
// exceeds maximum"), so Write rejects a longer value up front
// (audit.ErrRecordRejected) instead of failing in the database.
const maxIndexedBytes = 1024

// permanent reports whether a database error is caused by the records
// themselves, so repeating the write can never succeed: SQLSTATE class 22
// (data exception: a value out of range, invalid text or JSON) and 54
// (program limit exceeded: index row too big, too many columns). Every
// other error (connection lost, class 08; serialization or deadlock, 40;
// insufficient resources, 53; operator intervention, 57; ...) is
// temporary. (PostgreSQL "Appendix A. Error Codes".)
func permanent(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || len(pe.Code) != 5 {
		return false
	}
	switch pe.Code[:2] {
	case "22", "54":
		return true
	}
	return false
}

// rejected is Write's error for a record outside the store's bounds.
func rejected(format string, args ...any) error {
	return fmt.Errorf("pgstore: %w: %s", audit.ErrRecordRejected, fmt.Sprintf(format, args...))
}

// checkTime rejects a time PostgreSQL would store as another date or
// refuse (outside years 1-9999).
func checkTime(what string, i int, field string, t time.Time) error {
	if t.IsZero() {
		return nil
	}
	if y := t.Year(); y < 1 || y > 9999 {
		return rejected("%s[%d].%s year %d is outside 1-9999", what, i, field, y)
	}
	return nil
}

func checkText(what string, i int, fields map[string]string) error {
	for name, v := range fields {
		if len(v) > maxIndexedBytes {
			return rejected("%s[%d].%s is %d bytes, more than %d (maxIndexedBytes)", what, i, name, len(v), maxIndexedBytes)
		}
	}
	return nil
}

// SetAside stores records the Consumer could not write
// (audit.ErrRecordRejected) into the set_aside table with their reason; a
// record set aside again (same kind and record ID) is skipped. Ids are cut
// to 256 bytes for display; the whole record is kept as JSON. Errors: the
// database's (temporary: the Consumer retries).
func (s *Store) SetAside(ctx context.Context, records []audit.SetAside) error {
	if len(records) == 0 {
		return nil
	}
	n := len(records)
	ids, kinds, rids, mids, reasons := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	recs := make([][]byte, n)
	for i, r := range records {
		sum := sha256.Sum256([]byte(r.RecordID))
		ids[i] = cleanText(r.Kind) + ":" + hex.EncodeToString(sum[:])
		kinds[i], rids[i], mids[i] = cleanText(r.Kind), cleanText(cut(r.RecordID, 256)), cleanText(cut(r.MessageID, 256))
		reasons[i] = cleanText(cut(r.Reason, 4096))
		recs[i] = r.Record
		if recs[i] == nil {
			recs[i] = []byte{}
		}
	}
	_, err := s.pool.Exec(ctx, `INSERT INTO `+qualify(s.schema, "set_aside")+` (id, kind, record_id, message_id, reason, record)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[])
ON CONFLICT (id) DO NOTHING`, ids, kinds, rids, mids, reasons, recs)
	if err != nil {
		return fmt.Errorf("pgstore: set aside %d records: %w", n, err)
	}
	return nil
}

// cut shortens s to at most n bytes, on a UTF-8 boundary.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

type msgAgg struct {
	firstArrival, firstStarted pgtype.Timestamptz
	lastAttempt                *int32
	lastStarted                pgtype.Timestamptz
	lastID, lastOutcome        *string
}

func tstz(t time.Time) pgtype.Timestamptz {
	if t.IsZero() {
		return pgtype.Timestamptz{}
	}
	return pgtype.Timestamptz{Time: t, Valid: true}
}

// checkRecords refuses records Write cannot store: an empty ID, text
// PostgreSQL cannot hold, a time outside PostgreSQL's range.
func checkRecords(arrivals []audit.Arrival, attempts []audit.Attempt) error {
	for i := range arrivals {
		a := &arrivals[i]
		if a.ID == "" {
			return fmt.Errorf("pgstore: Write: arrivals[%d].ID is empty", i)
		}
		if err := checkText("arrivals", i, map[string]string{"ID": a.ID, "MessageID": a.MessageID, "CorrelationID": a.CorrelationID,
			"Exchange": a.Exchange, "RoutingKey": a.RoutingKey}); err != nil {
			return err
		}
		if err := errors.Join(checkTime("arrivals", i, "PublishedAt", a.PublishedAt), checkTime("arrivals", i, "ArrivedAt", a.ArrivedAt)); err != nil {
			return err
		}
	}
	for i := range attempts {
		a := &attempts[i]
		if a.ID == "" {
			return fmt.Errorf("pgstore: Write: attempts[%d].ID is empty", i)
		}
		if err := checkText("attempts", i, map[string]string{"ID": a.ID, "MessageID": a.MessageID, "CorrelationID": a.CorrelationID,
			"Queue": a.Queue, "Outcome": string(a.Outcome), "ErrorClass": a.ErrorClass}); err != nil {
			return err
		}
		if err := checkTime("attempts", i, "StartedAt", a.StartedAt); err != nil {
			return err
		}
	}
	return nil
}

// buildWriteBatch queues Write's statements after checkRecords: the
// arrivals and the attempts, each as one insert of arrays sorted by ID,
// and the per-message summary rows their records fold into.
func buildWriteBatch(q queries, arrivals []audit.Arrival, attempts []audit.Attempt) (*pgx.Batch, error) {
	if err := checkRecords(arrivals, attempts); err != nil {
		return nil, err
	}
	msgs := map[string]*msgAgg{}
	agg := func(id string) *msgAgg {
		m := msgs[id]
		if m == nil {
			m = &msgAgg{}
			msgs[id] = m
		}
		return m
	}
	b := &pgx.Batch{}

	if len(arrivals) > 0 {
		idx := sortedIdx(len(arrivals), func(i int) string { return arrivals[i].ID })
		n := len(arrivals)
		var (
			ids, mids, cids, exs, rks, hdrs, props = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
			pubs, arrs                             = make([]pgtype.Timestamptz, n), make([]pgtype.Timestamptz, n)
			bodies                                 = make([][]byte, n)
			sizes                                  = make([]int32, n)
			truncs                                 = make([]bool, n)
			tables                                 = make([]*string, n)
			dups                                   = make([]bool, n)
		)
		for k, i := range idx {
			a := &arrivals[i]
			ids[k], mids[k], cids[k] = cleanText(a.ID), cleanText(a.MessageID), cleanText(a.CorrelationID)
			exs[k], rks[k] = cleanText(a.Exchange), cleanText(a.RoutingKey)
			pubs[k], arrs[k] = tstz(a.PublishedAt), pgtype.Timestamptz{Time: a.ArrivedAt, Valid: true}
			hdrs[k] = jsonObject(a.Headers)
			props[k] = jsonObject(a.Properties)
			bodies[k] = a.Body
			if bodies[k] == nil {
				bodies[k] = []byte{}
			}
			sizes[k] = int32(min(max(a.BodySize, len(a.Body)), 1<<31-1))
			truncs[k], dups[k] = a.BodyTruncated, a.MaybeDuplicate
			if a.HeaderTable != nil {
				// Exact types for Resend; a table the codec cannot hold
				// (not from a delivery) keeps only the JSON form.
				if enc, err := wire.EncodeHeaderTable(a.HeaderTable); err == nil {
					tables[k] = &enc
				}
			}
			key := mids[k]
			if key == "" { // listed under its own record ID (see arrivalKey)
				key = ids[k]
			}
			m := agg(key)
			if !m.firstArrival.Valid || a.ArrivedAt.Before(m.firstArrival.Time) {
				m.firstArrival = arrs[k]
			}
		}
		b.Queue(q.insertArrivals, ids, mids, cids, exs, rks, pubs, arrs, hdrs, props, bodies, sizes, truncs, tables, dups)
	}

	if len(attempts) > 0 {
		idx := sortedIdx(len(attempts), func(i int) string { return attempts[i].ID })
		n := len(attempts)
		var (
			ids, mids, cids, queues, outcomes, classes, errs = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
			users                                            = make([]string, n)
			nums                                             = make([]int32, n)
			starts                                           = make([]pgtype.Timestamptz, n)
			durs, delays, tiers                              = make([]int64, n), make([]int64, n), make([]int64, n)
		)
		for k, i := range idx {
			a := &attempts[i]
			ids[k], mids[k], cids[k] = cleanText(a.ID), cleanText(a.MessageID), cleanText(a.CorrelationID)
			queues[k], outcomes[k] = cleanText(a.Queue), cleanText(string(a.Outcome))
			classes[k], errs[k] = cleanText(a.ErrorClass), cleanText(a.Error)
			users[k] = cleanText(a.RecordedBy)
			nums[k] = int32(min(max(a.Attempt, -1<<31), 1<<31-1))
			starts[k] = pgtype.Timestamptz{Time: a.StartedAt, Valid: true}
			durs[k], delays[k], tiers[k] = a.Duration.Microseconds(), a.Delay.Milliseconds(), a.Tier.Milliseconds()
			m := agg(mids[k])
			if !m.firstStarted.Valid || a.StartedAt.Before(m.firstStarted.Time) {
				m.firstStarted = starts[k]
			}
			if m.lastAttempt == nil || newer(nums[k], a.StartedAt, ids[k], *m.lastAttempt, m.lastStarted.Time, *m.lastID) {
				m.lastAttempt, m.lastStarted, m.lastID, m.lastOutcome = &nums[k], starts[k], &ids[k], &outcomes[k]
			}
		}
		b.Queue(q.insertAttempts, ids, mids, cids, queues, nums, starts, durs, outcomes, delays, tiers, classes, errs, users)
	}

	n := len(msgs)
	var (
		mids        = make([]string, 0, n)
		fa, fs, ls  = make([]pgtype.Timestamptz, n), make([]pgtype.Timestamptz, n), make([]pgtype.Timestamptz, n)
		la          = make([]*int32, n)
		lids, louts = make([]*string, n), make([]*string, n)
	)
	for id := range msgs {
		mids = append(mids, id)
	}
	sort.Strings(mids)
	for k, id := range mids {
		m := msgs[id]
		fa[k], fs[k], ls[k], la[k], lids[k], louts[k] = m.firstArrival, m.firstStarted, m.lastStarted, m.lastAttempt, m.lastID, m.lastOutcome
	}
	b.Queue(q.upsertMessages, mids, fa, fs, la, ls, lids, louts)
	return b, nil
}

// newer orders attempts by (attempt number, start, id in byte order), the
// order the messages table's last_* columns follow (COLLATE "C" there).
func newer(n int32, t time.Time, id string, on int32, ot time.Time, oid string) bool {
	if n != on {
		return n > on
	}
	// Compare at the database's microsecond resolution.
	tu, otu := t.UnixMicro(), ot.UnixMicro()
	if tu != otu {
		return tu > otu
	}
	return id > oid
}

func sortedIdx(n int, key func(int) string) []int {
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool { return key(idx[a]) < key(idx[b]) })
	return idx
}

// cleanText makes s storable in a PostgreSQL text column: invalid UTF-8
// and NUL bytes become U+FFFD.
func cleanText(s string) string {
	if utf8.ValidString(s) && strings.IndexByte(s, 0) < 0 {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// jsonObject renders a map as a JSON object jsonb accepts: never fails
// (unencodable values become their fmt.Sprint text), no \u0000 escapes.
func jsonObject[V any](m map[string]V) string {
	if len(m) == 0 {
		return "{}"
	}
	out, err := json.Marshal(m)
	if err != nil {
		safe := make(map[string]any, len(m))
		for k, v := range m {
			if _, err := json.Marshal(v); err != nil {
				safe[k] = fmt.Sprint(v)
			} else {
				safe[k] = v
			}
		}
		if out, err = json.Marshal(safe); err != nil {
			return "{}"
		}
	}
	if bytes.Contains(out, []byte(`\u0000`)) {
		var v any
		if json.Unmarshal(out, &v) == nil {
			if o, err := json.Marshal(cleanJSON(v)); err == nil {
				out = o
			}
		}
	}
	return string(out)
}

func cleanJSON(v any) any {
	switch x := v.(type) {
	case string:
		return cleanText(x)
	case map[string]any:
		o := make(map[string]any, len(x))
		for k, e := range x {
			o[cleanText(k)] = cleanJSON(e)
		}
		return o
	case []any:
		for i := range x {
			x[i] = cleanJSON(x[i])
		}
		return x
	}
	return v
}
