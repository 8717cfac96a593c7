package faults

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpretry/cascade"
	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	poisonadmin "github.com/rabbitretry/rabbitretry/poison/admin"
)

// lockedBuffer is a log sink shared by background goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// nopStore is an audit.Store that stores nothing and finds nothing.
type nopStore struct{}

func (nopStore) Write(context.Context, []audit.Arrival, []audit.Attempt) error { return nil }
func (nopStore) Search(context.Context, audit.Filter) ([]audit.Message, error) {
	return nil, nil
}

// TestNoPasswordInErrors runs every library entry point that takes an AMQP
// URI or a PostgreSQL DSN (audit.NewConsumer + Declare + Run,
// audit.NewRecorder, audit.NewResender + Resend, confirm.New,
// amqpretry.New, admin.New, cascade.NewPublisher, pgstore.New) with URIs and
// DSNs whose password is a sentinel: a URI that does not parse (bad port,
// an unencoded '/' in the password), a refused port, the real broker with
// a wrong password and an unknown vhost; URL and key=value DSNs. No error
// text and no log line may hold the sentinel.
func TestNoPasswordInErrors(t *testing.T) {
	brokerURI(t)
	uris, dsns := testkit.SentinelURIs(), testkit.SentinelDSNs()
	logs := &lockedBuffer{}
	logger := watermill.NewStdLoggerWithOut(logs, true, false)
	var mu sync.Mutex
	var texts []string
	check := func(what string, err error) {
		text := "<nil>"
		if err != nil {
			text = err.Error()
		}
		mu.Lock()
		texts = append(texts, what+": "+text)
		mu.Unlock()
	}
	// Every entry point with every URI, concurrently: a refused login
	// takes the broker seconds to answer.
	entries := []func(ctx context.Context, uri string){
		func(ctx context.Context, uri string) {
			c, err := audit.NewConsumer(audit.ConsumerConfig{URI: uri, Store: nopStore{},
				Exchanges: []audit.Binding{{Exchange: "amq.topic"}}, Logger: logger})
			check("audit.NewConsumer", err)
			if err == nil {
				check("audit.Consumer.Declare", c.Declare())
				rctx, cancel := context.WithTimeout(ctx, time.Second)
				defer cancel()
				check("audit.Consumer.Run", c.Run(rctx))
			}
		},
		func(ctx context.Context, uri string) {
			rec, err := audit.NewRecorder(audit.RecorderConfig{URI: uri, Logger: logger})
			check("audit.NewRecorder", err)
			if err == nil {
				_ = rec.Close(ctx)
			}
		},
		func(ctx context.Context, uri string) {
			rs, err := audit.NewResender(audit.ResenderConfig{URI: uri, Store: nopStore{}, Logger: logger})
			check("audit.NewResender", err)
			if err == nil {
				_, err = rs.Resend(ctx, audit.Filter{MessageID: "m"}, audit.ResendOptions{Mode: audit.ResendToExchange})
				check("audit.Resender.Resend", err)
				_ = rs.Close()
			}
		},
		func(ctx context.Context, uri string) {
			p, err := confirm.New(confirm.Config{URI: uri, Logger: logger})
			check("confirm.New", err)
			if err == nil {
				_ = p.Close()
			}
		},
		func(ctx context.Context, uri string) {
			r, err := amqpretry.New(amqpretry.Config{URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri), Logger: logger})
			check("amqpretry.New", err)
			if err == nil {
				_ = r.Close()
			}
		},
		func(ctx context.Context, uri string) {
			a, err := poisonadmin.New(poisonadmin.Config{URI: uri, Logger: logger})
			check("admin.New", err)
			if err == nil {
				_ = a.Close()
			}
		},
		func(ctx context.Context, uri string) {
			cp, err := cascade.NewPublisher(cascade.Config{URI: uri, Prefix: "secrets-test", Logger: logger})
			check("cascade.NewPublisher", err)
			if err == nil {
				_ = cp.Close()
			}
		},
	}
	var wg sync.WaitGroup
	for _, uri := range uris {
		for _, entry := range entries {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				entry(ctx, uri)
			}()
		}
	}
	for _, dsn := range dsns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			st, err := pgstore.New(ctx, pgstore.Config{DSN: dsn, ConnectTimeout: 3 * time.Second})
			check("pgstore.New", err)
			if err == nil {
				st.Close()
			}
		}()
	}
	wg.Wait()
	leaks := testkit.CheckNoSentinel(t, "entry points", append(texts, logs.String())...)
	for _, s := range texts {
		t.Log(s)
	}
	t.Logf("%d error texts, %d log bytes checked; %d leak(s)", len(texts), len(logs.String()), leaks)
}
