package pgstore

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/wire"
)

// Search returns the messages matching f (times in UTC, at microsecond
// resolution; each message whole, bodies included, so a page of 10,000
// messages holds up to 10,000 arrival bodies in memory: listings use
// SearchEach, which reads no body), newest first by
// message time
// (the first arrival's arrived_at, else the first attempt's started_at;
// ties by message id, descending), each with its first arrival that
// matches the filter's Exchange, RoutingKey and Headers (the first arrival
// when none of them is set; nil if none is stored), the number of its
// arrivals that match and of different contents among them
// (Message.ArrivalCount, ArrivalVariants), and its attempts oldest first
// (by started_at, then attempt number).
//
// Filter semantics: MessageID matches exactly; CorrelationID an arrival's
// or an attempt's; From <= message time < To; Exchange, RoutingKey and
// Headers (jsonb containment, headers @> f.Headers) must hold for one same
// arrival; Queue, Outcome, ErrorClass and ErrorContains (case-insensitive
// substring, ILIKE with %, _ and \ escaped) for one same attempt;
// LastOutcome is the outcome of the message's latest attempt (highest
// attempt number, then latest start); MessageID also finds an arrival
// without message id by its record ID. Limit is defaultLimit when 0;
// After is a cursor from NextCursor, cursorOf or SearchPage: only messages
// that sort after it are returned, so paging with the last message's
// cursor returns every message once.
//
// Errors wrapping audit.ErrInvalidFilter (each naming the field):
// Filter.Limit negative or above 10,000, a Filter.Validate error (From
// not before To, text that is not valid UTF-8 or holds a NUL byte), an
// After that is not a cursor; Headers JSON cannot encode; the database's.
func (s *Store) Search(ctx context.Context, f audit.Filter) ([]audit.Message, error) {
	msgs, _, err := s.SearchPage(ctx, f)
	return msgs, err
}

// SearchPage is Search that also returns the cursor of the next page:
// pass it as Filter.After. It is "" when this page is the last one (fewer
// than the limit).
func (s *Store) SearchPage(ctx context.Context, f audit.Filter) ([]audit.Message, string, error) {
	ids, next, err := s.searchIDs(ctx, f)
	if err != nil {
		return nil, "", err
	}
	msgs, err := s.load(ctx, ids, f, true)
	if err != nil {
		return nil, "", err
	}
	return msgs, next, nil
}

// eachChunk is how many messages SearchEach loads at a time.
const eachChunk = 100

// SearchEach is SearchPage for listings: it calls fn with each message
// matching f, in Search's order, WITHOUT its arrival's body (Arrival.Body
// nil; BodySize and BodyTruncated kept: Get returns the body), loading the
// messages eachChunk (100) at a time, so memory stays bounded by one chunk
// of headers and attempts whatever the limit and the bodies' size. It
// returns SearchPage's next cursor. An error of fn stops it and is
// returned as is; Search's errors otherwise.
func (s *Store) SearchEach(ctx context.Context, f audit.Filter, fn func(audit.Message) error) (string, error) {
	ids, next, err := s.searchIDs(ctx, f)
	if err != nil {
		return "", err
	}
	for len(ids) > 0 {
		n := min(eachChunk, len(ids))
		msgs, err := s.load(ctx, ids[:n], f, false)
		if err != nil {
			return "", err
		}
		for _, m := range msgs {
			if err := fn(m); err != nil {
				return "", err
			}
		}
		ids = ids[n:]
	}
	return next, nil
}

// searchIDs returns the message ids of the page f selects and the next
// page's cursor.
func (s *Store) searchIDs(ctx context.Context, f audit.Filter) ([]string, string, error) {
	sql, args, limit, err := s.searchSQL(f)
	if err != nil {
		return nil, "", err
	}
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, "", fmt.Errorf("pgstore: search: %w", err)
	}
	type key struct {
		id string
		t  time.Time
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (key, error) {
		var k key
		err := r.Scan(&k.id, &k.t)
		return k, err
	})
	if err != nil {
		return nil, "", fmt.Errorf("pgstore: search: %w", err)
	}
	ids := make([]string, len(keys))
	for i, k := range keys {
		ids[i] = k.id
	}
	next := ""
	if len(keys) == limit {
		last := keys[len(keys)-1]
		next = encodeCursor(last.t, last.id)
	}
	return ids, next, nil
}

// Get returns the message with this id, with its first arrival and all its
// attempts; false if the store has no record of it. An id that is not
// valid UTF-8 or holds a NUL byte is an error wrapping
// audit.ErrInvalidFilter.
func (s *Store) Get(ctx context.Context, messageID string) (audit.Message, bool, error) {
	if err := (audit.Filter{MessageID: messageID}).Validate(); err != nil {
		return audit.Message{}, false, fmt.Errorf("pgstore: %w", err)
	}
	msgs, err := s.load(ctx, []string{messageID}, audit.Filter{}, true)
	if err != nil {
		return audit.Message{}, false, err
	}
	m := msgs[0]
	return m, m.Arrival != nil || len(m.Attempts) > 0, nil
}

// load returns one Message per id, in the order of ids, each with its
// first arrival that matches f's arrival conditions (Exchange,
// RoutingKey, Headers) and the counts of those (Message.ArrivalCount,
// ArrivalVariants); without bodies (Arrival.Body nil) unless bodies.
func (s *Store) load(ctx context.Context, ids []string, f audit.Filter, bodies bool) ([]audit.Message, error) {
	out := make([]audit.Message, len(ids))
	pos := make(map[string]int, len(ids))
	for i, id := range ids {
		out[i] = audit.Message{MessageID: id, Attempts: []audit.Attempt{}}
		pos[id] = i
	}
	if len(ids) == 0 {
		return out, nil
	}
	arrSQL, arrArgs := s.q.arrivalsOf, []any{ids}
	if !bodies {
		arrSQL = s.q.arrivalsOfNoBody
	}
	args := sqlArgs{args: []any{ids}}
	ac, err := arrivalConds(f, &args)
	if err != nil {
		return nil, err
	}
	if len(ac) > 0 {
		arrSQL, arrArgs = arrivalsOfSQL(s.q.arrivals, strings.Join(ac, " AND "), bodies), args.args
	}
	rows, err := s.pool.Query(ctx, arrSQL, arrArgs...)
	if err != nil {
		return nil, fmt.Errorf("pgstore: load arrivals: %w", err)
	}
	arrs, err := pgx.CollectRows(rows, scanKeyedArrival)
	if err != nil {
		return nil, fmt.Errorf("pgstore: load arrivals: %w", err)
	}
	for i := range arrs {
		if !bodies {
			arrs[i].a.Body = nil
		}
		if p, ok := pos[arrs[i].key]; ok {
			out[p].Arrival = &arrs[i].a
			out[p].ArrivalCount, out[p].ArrivalVariants = int(arrs[i].count), int(arrs[i].variants)
		}
	}
	rows, err = s.pool.Query(ctx, s.q.attemptsOf, ids)
	if err != nil {
		return nil, fmt.Errorf("pgstore: load attempts: %w", err)
	}
	atts, err := pgx.CollectRows(rows, scanAttempt)
	if err != nil {
		return nil, fmt.Errorf("pgstore: load attempts: %w", err)
	}
	for _, a := range atts {
		if i, ok := pos[a.MessageID]; ok {
			out[i].Attempts = append(out[i].Attempts, a)
		}
	}
	return out, nil
}

type keyedArrival struct {
	key             string
	a               audit.Arrival
	count, variants int64
}

func scanKeyedArrival(r pgx.CollectableRow) (keyedArrival, error) {
	var (
		k           keyedArrival
		pub         pgtype.Timestamptz
		hdrs, props []byte
		size        int32
		table       *string
	)
	a := &k.a
	if err := r.Scan(&k.key, &a.ID, &a.MessageID, &a.CorrelationID, &a.Exchange, &a.RoutingKey, &pub, &a.ArrivedAt,
		&hdrs, &props, &a.Body, &size, &a.BodyTruncated, &table, &a.MaybeDuplicate, &k.count, &k.variants); err != nil {
		return k, err
	}
	if table != nil {
		t, err := wire.DecodeHeaderTable(*table)
		if err != nil {
			return k, fmt.Errorf("arrival %s header table: %w", a.ID, err)
		}
		a.HeaderTable = t
	}
	return k, finishArrival(a, pub, hdrs, props, size)
}

func finishArrival(a *audit.Arrival, pub pgtype.Timestamptz, hdrs, props []byte, size int32) error {
	if pub.Valid {
		a.PublishedAt = pub.Time.UTC()
	}
	a.ArrivedAt = a.ArrivedAt.UTC()
	a.BodySize = int(size)
	if a.Body == nil {
		a.Body = []byte{}
	}
	if len(hdrs) > 0 && string(hdrs) != "{}" {
		if err := json.Unmarshal(hdrs, &a.Headers); err != nil {
			return fmt.Errorf("arrival %s headers: %w", a.ID, err)
		}
	}
	if len(props) > 0 && string(props) != "{}" {
		if err := json.Unmarshal(props, &a.Properties); err != nil {
			return fmt.Errorf("arrival %s properties: %w", a.ID, err)
		}
	}
	return nil
}

func scanAttempt(r pgx.CollectableRow) (audit.Attempt, error) {
	var (
		a                audit.Attempt
		num              int32
		dur, delay, tier int64
		outcome          string
	)
	if err := r.Scan(&a.ID, &a.MessageID, &a.CorrelationID, &a.Queue, &num, &a.StartedAt, &dur, &outcome,
		&delay, &tier, &a.ErrorClass, &a.Error, &a.RecordedBy); err != nil {
		return a, err
	}
	a.Attempt = int(num)
	a.StartedAt = a.StartedAt.UTC()
	a.Duration = time.Duration(dur) * time.Microsecond
	a.Delay = time.Duration(delay) * time.Millisecond
	a.Tier = time.Duration(tier) * time.Millisecond
	a.Outcome = audit.Outcome(outcome)
	return a, nil
}

type sqlArgs struct{ args []any }

func (a *sqlArgs) add(v any) string {
	a.args = append(a.args, v)
	return "$" + strconv.Itoa(len(a.args))
}

// likeEscape escapes the LIKE wildcards of s (backslash is ILIKE's default
// escape character).
func likeEscape(s string) string {
	return strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`).Replace(s)
}

// arrivalConds are the Filter's conditions on one arrival (alias a):
// Exchange, RoutingKey, Headers.
func arrivalConds(f audit.Filter, a *sqlArgs) ([]string, error) {
	var ac []string
	if f.Exchange != "" {
		ac = append(ac, "a.exchange = "+a.add(f.Exchange))
	}
	if f.RoutingKey != "" {
		ac = append(ac, "a.routing_key = "+a.add(f.RoutingKey))
	}
	if len(f.Headers) > 0 {
		h, err := json.Marshal(f.Headers)
		if err != nil {
			return nil, fmt.Errorf("pgstore: Filter.Headers: %w", err)
		}
		ac = append(ac, "a.headers @> "+a.add(string(h))+"::jsonb")
	}
	return ac, nil
}

// searchSQL builds the page query: message ids and times, newest first.
// Values are bind parameters only.
func (s *Store) searchSQL(f audit.Filter) (string, []any, int, error) {
	limit := f.Limit
	switch {
	case limit < 0 || limit > maxLimit:
		return "", nil, 0, fmt.Errorf("pgstore: %w: Filter.Limit %d: want 0 (default %d) to %d", audit.ErrInvalidFilter, f.Limit, defaultLimit, maxLimit)
	case limit == 0:
		limit = defaultLimit
	}
	if err := f.Validate(); err != nil {
		return "", nil, 0, fmt.Errorf("pgstore: %w", err)
	}
	var a sqlArgs
	var conds []string
	if f.MessageID != "" {
		conds = append(conds, "m.message_id = "+a.add(f.MessageID))
	}
	if f.CorrelationID != "" {
		p := a.add(f.CorrelationID)
		// "<> ''" lets generic plans use the partial indexes.
		conds = append(conds, "m.message_id IN (SELECT "+arrivalKey("")+" FROM "+s.q.arrivals+" WHERE correlation_id = "+p+" AND correlation_id <> ''"+
			" UNION SELECT message_id FROM "+s.q.attempts+" WHERE correlation_id = "+p+" AND correlation_id <> '')")
	}
	if !f.From.IsZero() {
		conds = append(conds, "m.message_time >= "+a.add(f.From))
	}
	if !f.To.IsZero() {
		conds = append(conds, "m.message_time < "+a.add(f.To))
	}
	ac, err := arrivalConds(f, &a)
	if err != nil {
		return "", nil, 0, err
	}
	if len(ac) > 0 {
		conds = append(conds, "m.message_id IN (SELECT "+arrivalKey("a.")+" FROM "+s.q.arrivals+" a WHERE "+strings.Join(ac, " AND ")+")")
	}
	var tc []string
	if f.Queue != "" {
		tc = append(tc, "t.queue = "+a.add(f.Queue))
	}
	if f.Outcome != "" {
		tc = append(tc, "t.outcome = "+a.add(string(f.Outcome)))
	}
	if f.ErrorClass != "" {
		tc = append(tc, "t.error_class = "+a.add(f.ErrorClass)+" AND t.error_class <> ''")
	}
	if f.ErrorContains != "" {
		tc = append(tc, "t.error ILIKE "+a.add("%"+likeEscape(f.ErrorContains)+"%"))
	}
	if len(tc) > 0 {
		conds = append(conds, "m.message_id IN (SELECT t.message_id FROM "+s.q.attempts+" t WHERE "+strings.Join(tc, " AND ")+")")
	}
	if f.LastOutcome != "" {
		conds = append(conds, "m.last_outcome = "+a.add(string(f.LastOutcome)))
	}
	if f.After != "" {
		t, id, err := decodeCursor(f.After)
		if err != nil {
			return "", nil, 0, err
		}
		conds = append(conds, "(m.message_time, m.message_id) < ("+a.add(t)+"::timestamptz, "+a.add(id)+"::text)")
	}
	sql := "SELECT m.message_id, m.message_time FROM " + s.q.messages + " m"
	if len(conds) > 0 {
		sql += "\nWHERE " + strings.Join(conds, "\n  AND ")
	}
	sql += "\nORDER BY m.message_time DESC, m.message_id DESC\nLIMIT " + a.add(limit)
	return sql, a.args, limit, nil
}

const cursorPrefix = "c1."

func encodeCursor(t time.Time, id string) string {
	return cursorPrefix + base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(t.UnixMicro(), 10)+":"+id))
}

func decodeCursor(c string) (time.Time, string, error) {
	bad := func() (time.Time, string, error) {
		return time.Time{}, "", fmt.Errorf("pgstore: %w: Filter.After %q is not a cursor from this store", audit.ErrInvalidFilter, strings.ToValidUTF8(strings.ReplaceAll(c, "\x00", `\0`), "?"))
	}
	rest, ok := strings.CutPrefix(c, cursorPrefix)
	if !ok {
		return bad()
	}
	raw, err := base64.RawURLEncoding.DecodeString(rest)
	if err != nil {
		return bad()
	}
	us, id, ok := strings.Cut(string(raw), ":")
	if !ok {
		return bad()
	}
	n, err := strconv.ParseInt(us, 10, 64)
	if err != nil {
		return bad()
	}
	return time.UnixMicro(n).UTC(), id, nil
}

// cursorOf returns the Filter.After cursor that pages past m: its time is
// the arrival's ArrivedAt, else the first attempt's StartedAt, as Search
// sorts. With a filter on Exchange, RoutingKey or Headers, m.Arrival is the
// first arrival that matched, which may be later than the message's first
// one (its sort time): page with SearchPage's cursor then. Errors if m has
// neither.
func cursorOf(m audit.Message) (string, error) {
	switch {
	case m.Arrival != nil:
		return encodeCursor(m.Arrival.ArrivedAt, m.MessageID), nil
	case len(m.Attempts) > 0:
		first := m.Attempts[0].StartedAt
		for _, a := range m.Attempts[1:] {
			if a.StartedAt.Before(first) {
				first = a.StartedAt
			}
		}
		return encodeCursor(first, m.MessageID), nil
	}
	return "", errors.New("pgstore: cursorOf: message has no arrival and no attempts")
}
