package pgstore

import (
	"strings"

	"github.com/jackc/pgx/v5"
)

// qualify quotes schema.table.
func qualify(schema, table string) string { return pgx.Identifier{schema, table}.Sanitize() }

// arrivalKey is an arrival's message key column (migration 0002): its
// message id, or for an arrival without one its own record ID (so messages
// without id are listed one by one, not merged under ""). alias is the
// table alias with its dot ("a.") or "".
func arrivalKey(alias string) string { return alias + "message_key" }

// resendHeaders is an arrival's headers without those a resend does not
// carry (audit's stripHeader: retry state of rabbitretry and the broker),
// so that an earlier resent copy (which adds rabbitretry-resent) is not a
// variant of its original.
const resendHeaders = `(SELECT COALESCE(jsonb_object_agg(h.key, h.value), '{}'::jsonb) FROM jsonb_each(a.headers) h
		WHERE h.key NOT LIKE 'rabbitretry-%' AND h.key NOT LIKE 'x-first-death-%' AND h.key NOT LIKE 'x-last-death-%'
		AND h.key NOT IN ('x-death', 'x-delivery-count', 'x-acquired-count', 'reason_poisoned', 'topic_poisoned', 'handler_poisoned', 'subscriber_poisoned'))`

// arrivalsOfSQL selects, per message key in $1, the first (oldest)
// arrival that matches cond (arrival conditions on alias a, "" for none),
// with the number of matching arrivals and of distinct contents among
// them (what a resend would publish: exchange, routing key, headers,
// properties, body).
func arrivalsOfSQL(arrivals, cond string, bodies bool) string {
	where := "a.message_key = ANY($1)"
	if cond != "" {
		where += " AND " + cond
	}
	cols := prefixed("a.", arrivalCols)
	if !bodies {
		cols = strings.Replace(cols, "a.body, a.body_size", "NULL::bytea AS body, a.body_size", 1)
	}
	// Contents are compared (md5 of bodies) only for message keys with
	// more than one matching arrival: a page of single arrivals reads each
	// body once.
	return `WITH n AS (SELECT a.message_key, count(*) AS arrivals FROM ` + arrivals + ` a WHERE ` + where + ` GROUP BY a.message_key),
v AS (SELECT a.message_key, count(DISTINCT (a.exchange, a.routing_key, ` + resendHeaders + `, a.properties - 'user-id', md5(a.body), a.body_size)::text) AS variants
	FROM ` + arrivals + ` a JOIN n ON n.message_key = a.message_key AND n.arrivals > 1 WHERE ` + where + ` GROUP BY a.message_key)
SELECT DISTINCT ON (a.message_key) a.message_key, ` + cols + `, n.arrivals, COALESCE(v.variants, 1)
FROM ` + arrivals + ` a JOIN n ON n.message_key = a.message_key LEFT JOIN v ON v.message_key = a.message_key
WHERE ` + where + ` ORDER BY a.message_key, a.arrived_at, a.id`
}

func prefixed(alias, cols string) string {
	parts := strings.Split(cols, ", ")
	for i := range parts {
		parts[i] = alias + parts[i]
	}
	return strings.Join(parts, ", ")
}

// queries are the store's statements with its schema filled in (quoted
// identifiers only; every value is a bind parameter).
type queries struct {
	arrivals, attempts, messages, unacked string

	insertArrivals, insertAttempts, upsertMessages string
	arrivalsOf, attemptsOf                         string
	arrivalsOfNoBody                               string
	rebuildMessages                                string
}

const arrivalCols = `id, message_id, correlation_id, exchange, routing_key, published_at, arrived_at, headers, properties, body, body_size, body_truncated, header_table, maybe_duplicate`
const attemptCols = `id, message_id, correlation_id, queue, attempt, started_at, duration_us, outcome, delay_ms, tier_ms, error_class, error, recorded_by`

func buildQueries(schema string) queries {
	q := queries{
		arrivals: qualify(schema, "arrivals"),
		attempts: qualify(schema, "attempts"),
		messages: qualify(schema, "messages"),
		unacked:  qualify(schema, "unacked_arrivals"),
	}
	r := strings.NewReplacer("{arrivals}", q.arrivals, "{attempts}", q.attempts, "{messages}", q.messages)
	q.insertArrivals = r.Replace(`INSERT INTO {arrivals} (` + arrivalCols + `)
SELECT id, mid, cid, ex, rk, pub, arr, h::jsonb, p::jsonb, body, size, trunc, ht, dup
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[], $7::timestamptz[],
            $8::text[], $9::text[], $10::bytea[], $11::int[], $12::bool[], $13::text[], $14::bool[])
     AS r(id, mid, cid, ex, rk, pub, arr, h, p, body, size, trunc, ht, dup)
ON CONFLICT (id) DO NOTHING`)
	q.insertAttempts = r.Replace(`INSERT INTO {attempts} (` + attemptCols + `)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::timestamptz[], $7::bigint[],
                     $8::text[], $9::bigint[], $10::bigint[], $11::text[], $12::text[], $13::text[])
ON CONFLICT (id) DO NOTHING`)
	newer := `(EXCLUDED.last_attempt IS NOT NULL AND (m.last_attempt IS NULL OR
	(EXCLUDED.last_attempt, EXCLUDED.last_started_at, EXCLUDED.last_attempt_id COLLATE "C") > (m.last_attempt, m.last_started_at, m.last_attempt_id COLLATE "C")))`
	q.upsertMessages = r.Replace(`INSERT INTO {messages} AS m (message_id, first_arrival_at, first_started_at, last_attempt, last_started_at, last_attempt_id, last_outcome)
SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::timestamptz[], $4::int[], $5::timestamptz[], $6::text[], $7::text[])
ON CONFLICT (message_id) DO UPDATE SET
	first_arrival_at = LEAST(m.first_arrival_at, EXCLUDED.first_arrival_at),
	first_started_at = LEAST(m.first_started_at, EXCLUDED.first_started_at),
	last_attempt    = CASE WHEN ` + newer + ` THEN EXCLUDED.last_attempt    ELSE m.last_attempt    END,
	last_started_at = CASE WHEN ` + newer + ` THEN EXCLUDED.last_started_at ELSE m.last_started_at END,
	last_attempt_id = CASE WHEN ` + newer + ` THEN EXCLUDED.last_attempt_id ELSE m.last_attempt_id END,
	last_outcome    = CASE WHEN ` + newer + ` THEN EXCLUDED.last_outcome    ELSE m.last_outcome    END`)
	q.arrivalsOf = arrivalsOfSQL(q.arrivals, "", true)
	// The same without the body (NULL), for listings: the body is not even
	// read from its TOAST table (unless an id has several arrivals to compare).
	q.arrivalsOfNoBody = arrivalsOfSQL(q.arrivals, "", false)
	q.attemptsOf = r.Replace(`SELECT ` + attemptCols + ` FROM {attempts}
WHERE message_id = ANY($1) ORDER BY message_id, started_at, attempt, id`)
	// The messages rows of the message keys $1 that have records,
	// recomputed from them (Prune's repair of a row deleted under a
	// concurrent Write).
	q.rebuildMessages = r.Replace(`INSERT INTO {messages} (message_id, first_arrival_at, first_started_at, last_attempt, last_started_at, last_attempt_id, last_outcome)
SELECT k.id,
	(SELECT min(a.arrived_at) FROM {arrivals} a WHERE a.message_key = k.id),
	(SELECT min(t.started_at) FROM {attempts} t WHERE t.message_id = k.id),
	l.attempt, l.started_at, l.id, l.outcome
FROM unnest($1::text[]) AS k(id)
LEFT JOIN LATERAL (SELECT t.attempt, t.started_at, t.id, t.outcome FROM {attempts} t WHERE t.message_id = k.id
	ORDER BY t.attempt DESC, t.started_at DESC, t.id COLLATE "C" DESC LIMIT 1) l ON true
WHERE EXISTS (SELECT 1 FROM {arrivals} a WHERE a.message_key = k.id)
   OR EXISTS (SELECT 1 FROM {attempts} t WHERE t.message_id = k.id)
ON CONFLICT (message_id) DO NOTHING`)
	return q
}
