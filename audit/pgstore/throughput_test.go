package pgstore

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
)

// throughputBatch returns a batch of n records like the audit consumer's:
// one arrival (512-byte body, 3 headers) per two attempts.
func throughputBatch(prefix string, n int) ([]audit.Arrival, []audit.Attempt) {
	var arr []audit.Arrival
	var att []audit.Attempt
	body := make([]byte, 512)
	for i := range body {
		body[i] = byte(i)
	}
	for i := 0; len(arr)+len(att) < n; i++ {
		mid := fmt.Sprintf("%s-%06d", prefix, i)
		at := t0.Add(time.Duration(i) * time.Millisecond)
		a := arrival(mid, at)
		a.Headers = map[string]any{"tenant": "acme", "region": "eu", "trace": mid}
		a.Body, a.BodySize = body, len(body)
		arr = append(arr, a)
		att = append(att, attempt(mid, 1, at, audit.OutcomeRetry))
		if len(arr)+len(att) < n {
			att = append(att, attempt(mid, 2, at.Add(time.Second), audit.OutcomeSuccess))
		}
	}
	return arr, att
}

// writeCopy is the alternative Write measured against the unnest one:
// COPY into temporary tables, then INSERT ... SELECT ... ON CONFLICT DO
// NOTHING (and the same messages upsert).
func (s *Store) writeCopy(ctx context.Context, arrivals []audit.Arrival, attempts []audit.Attempt) error {
	full, err := buildWriteBatch(s.q, arrivals, attempts)
	if err != nil {
		return err
	}
	msgUpsert := full.QueuedQueries[len(full.QueuedQueries)-1]
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `CREATE TEMP TABLE IF NOT EXISTS tmp_arrivals (LIKE `+s.q.arrivals+` INCLUDING DEFAULTS) ON COMMIT DELETE ROWS;
			CREATE TEMP TABLE IF NOT EXISTS tmp_attempts (LIKE `+s.q.attempts+` INCLUDING DEFAULTS) ON COMMIT DELETE ROWS`); err != nil {
			return err
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"tmp_arrivals"}, []string{"id", "message_id", "correlation_id", "exchange", "routing_key", "published_at", "arrived_at", "headers", "properties", "body", "body_size", "body_truncated"},
			pgx.CopyFromSlice(len(arrivals), func(i int) ([]any, error) {
				a := arrivals[i]
				return []any{a.ID, a.MessageID, a.CorrelationID, a.Exchange, a.RoutingKey, tstz(a.PublishedAt), a.ArrivedAt,
					jsonObject(a.Headers), jsonObject(a.Properties), a.Body, int32(a.BodySize), a.BodyTruncated}, nil
			})); err != nil {
			return err
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"tmp_attempts"}, []string{"id", "message_id", "correlation_id", "queue", "attempt", "started_at", "duration_us", "outcome", "delay_ms", "tier_ms", "error_class", "error"},
			pgx.CopyFromSlice(len(attempts), func(i int) ([]any, error) {
				a := attempts[i]
				return []any{a.ID, a.MessageID, a.CorrelationID, a.Queue, int32(a.Attempt), a.StartedAt, a.Duration.Microseconds(),
					string(a.Outcome), a.Delay.Milliseconds(), a.Tier.Milliseconds(), a.ErrorClass, a.Error}, nil
			})); err != nil {
			return err
		}
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO ` + s.q.arrivals + ` (` + arrivalCols + `) SELECT ` + arrivalCols + ` FROM tmp_arrivals ORDER BY id ON CONFLICT (id) DO NOTHING`)
		b.Queue(`INSERT INTO ` + s.q.attempts + ` SELECT * FROM tmp_attempts ORDER BY id ON CONFLICT (id) DO NOTHING`)
		b.Queue(msgUpsert.SQL, msgUpsert.Arguments...)
		return tx.SendBatch(ctx, b).Close()
	})
}

// writeRows is the other alternative: a pgx.Batch of one INSERT per row.
func (s *Store) writeRows(ctx context.Context, arrivals []audit.Arrival, attempts []audit.Attempt) error {
	full, err := buildWriteBatch(s.q, arrivals, attempts)
	if err != nil {
		return err
	}
	msgUpsert := full.QueuedQueries[len(full.QueuedQueries)-1]
	b := &pgx.Batch{}
	for _, a := range arrivals {
		b.Queue(`INSERT INTO `+s.q.arrivals+` (`+arrivalCols+`) VALUES ($1,$2,$3,$4,$5,$6,$7,$8::jsonb,$9::jsonb,$10,$11,$12,NULL,false) ON CONFLICT (id) DO NOTHING`,
			a.ID, a.MessageID, a.CorrelationID, a.Exchange, a.RoutingKey, tstz(a.PublishedAt), a.ArrivedAt,
			jsonObject(a.Headers), jsonObject(a.Properties), a.Body, int32(a.BodySize), a.BodyTruncated)
	}
	for _, a := range attempts {
		b.Queue(`INSERT INTO `+s.q.attempts+` (`+attemptCols+`) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13) ON CONFLICT (id) DO NOTHING`,
			a.ID, a.MessageID, a.CorrelationID, a.Queue, int32(a.Attempt), a.StartedAt, a.Duration.Microseconds(),
			string(a.Outcome), a.Delay.Milliseconds(), a.Tier.Milliseconds(), a.ErrorClass, a.Error, a.RecordedBy)
	}
	b.Queue(msgUpsert.SQL, msgUpsert.Arguments...)
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error { return tx.SendBatch(ctx, b).Close() })
}

// TestWriteThroughput measures Write (unnest) against the COPY and
// row-by-row alternatives: batches of 500 records (1 arrival with a
// 512-byte body per 2 attempts), one writer, into fresh tables with all
// indexes. RABBITRETRY_PG_THROUGHPUT_BATCHES sets the batch count (20).
func TestWriteThroughput(t *testing.T) {
	batches := 20
	if v, err := strconv.Atoi(os.Getenv("RABBITRETRY_PG_THROUGHPUT_BATCHES")); err == nil && v > 0 {
		batches = v
	}
	const size = 500
	ctx := context.Background()
	methods := []struct {
		name  string
		write func(*Store) func(context.Context, []audit.Arrival, []audit.Attempt) error
	}{
		{"unnest(Write)", func(s *Store) func(context.Context, []audit.Arrival, []audit.Attempt) error { return s.Write }},
		{"copy+insert", func(s *Store) func(context.Context, []audit.Arrival, []audit.Attempt) error { return s.writeCopy }},
		{"batch-rows", func(s *Store) func(context.Context, []audit.Arrival, []audit.Attempt) error { return s.writeRows }},
	}
	rates := map[string]float64{}
	for _, m := range methods {
		s := newTestStore(t)
		w := m.write(s)
		type bt struct {
			arr []audit.Arrival
			att []audit.Attempt
		}
		var bs []bt
		for i := range batches {
			a, b := throughputBatch(fmt.Sprintf("b%03d", i), size)
			bs = append(bs, bt{a, b})
		}
		start := time.Now()
		for _, b := range bs {
			if err := w(ctx, b.arr, b.att); err != nil {
				t.Fatalf("%s: %v", m.name, err)
			}
		}
		el := time.Since(start)
		a, b, _ := counts(t, s)
		if a+b != int64(batches*size) {
			t.Fatalf("%s stored %d records, want %d", m.name, a+b, batches*size)
		}
		// Rewrite (redelivery) cost: every record a conflict.
		start = time.Now()
		for _, b := range bs[:5] {
			if err := w(ctx, b.arr, b.att); err != nil {
				t.Fatal(err)
			}
		}
		rel := time.Since(start)
		rates[m.name] = float64(batches*size) / el.Seconds()
		t.Logf("THROUGHPUT %-14s %d batches x %d records: %v, %.0f records/s (%.1f ms/batch); rewrite of 5 stored batches %.1f ms/batch",
			m.name, batches, size, el.Round(time.Millisecond), rates[m.name], el.Seconds()*1000/float64(batches), rel.Seconds()*1000/5)
	}
	if r := rates["unnest(Write)"]; r < 1000 {
		t.Errorf("Write managed %.0f records/s, far below the 5,000/s target", r)
	}
}

// BenchmarkWrite500 writes batches of 500 new records with Write; reports
// records/s.
func BenchmarkWrite500(b *testing.B) {
	s := newTestStore(b)
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		arr, att := throughputBatch(fmt.Sprintf("bench%06d", i), 500)
		b.StartTimer()
		if err := s.Write(ctx, arr, att); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*500)/b.Elapsed().Seconds(), "records/s")
}

// TestDeliveryLogThroughput measures the Consumer's store work per batch
// with the delivery log: WriteDeliveries (500 records, a row per arrival),
// then the one statement per batch on its rows, the old one (DELETE by
// session and IDs after the ack) against DeliveriesAcking (before the
// ack: delete the rows marked before, mark these). One writer, batches
// of RABBITRETRY_PG_THROUGHPUT_BATCHES (20).
func TestDeliveryLogThroughput(t *testing.T) {
	batches := 20
	if v, err := strconv.Atoi(os.Getenv("RABBITRETRY_PG_THROUGHPUT_BATCHES")); err == nil && v > 0 {
		batches = v
	}
	const size = 500
	ctx := context.Background()
	methods := []struct {
		name string
		ack  func(s *Store, session string, ids []string) error
	}{
		{"delete-after-ack", func(s *Store, session string, ids []string) error {
			_, err := s.pool.Exec(ctx, `DELETE FROM `+s.q.unacked+` WHERE (session = $1 AND arrival_id = ANY($2)) OR since < now() - interval '1 day'`, session, ids)
			return err
		}},
		{"acking-before-ack", func(s *Store, session string, ids []string) error {
			return (*deliveryLog)(s).DeliveriesAcking(ctx, session, ids)
		}},
	}
	for _, m := range methods {
		s := newTestStore(t)
		type bt struct {
			arr []audit.Arrival
			att []audit.Attempt
			d   []deliverylog.Delivery
			ids []string
		}
		var bs []bt
		for i := range batches {
			a, b := throughputBatch(fmt.Sprintf("b%03d", i), size)
			x := bt{arr: a, att: b}
			for j := range a {
				a[j].ID = fmt.Sprintf("b%03d-%04d", i, j)
				x.d = append(x.d, deliverylog.Delivery{ArrivalID: a[j].ID, Fingerprint: fmt.Sprint("fp-", j), Session: "s"})
				x.ids = append(x.ids, a[j].ID)
			}
			bs = append(bs, x)
		}
		var ackTime time.Duration
		start := time.Now()
		for _, b := range bs {
			if err := (*deliveryLog)(s).WriteDeliveries(ctx, b.arr, b.att, b.d); err != nil {
				t.Fatal(err)
			}
			st := time.Now()
			if err := m.ack(s, "s", b.ids); err != nil {
				t.Fatal(err)
			}
			ackTime += time.Since(st)
		}
		el := time.Since(start)
		t.Logf("THROUGHPUT %-18s %d batches x %d records: %.0f records/s (%.1f ms/batch, of which the rows statement %.2f ms)",
			m.name, batches, size, float64(batches*size)/el.Seconds(), el.Seconds()*1000/float64(batches), ackTime.Seconds()*1000/float64(batches))
	}
}
