package amqpretry_test

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

// deadlineLog records the library's log lines.
type deadlineLog struct {
	watermill.NopLogger
	mu    sync.Mutex
	lines []deadlineLine
}

type deadlineLine struct {
	level, msg string
	fields     watermill.LogFields
}

func (l *deadlineLog) Error(msg string, _ error, f watermill.LogFields) { l.add("error", msg, f) }
func (l *deadlineLog) Info(msg string, f watermill.LogFields)           { l.add("info", msg, f) }
func (l *deadlineLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }
func (l *deadlineLog) add(level, msg string, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, deadlineLine{level, msg, f})
}

func (l *deadlineLog) find(level, substr string) []deadlineLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []deadlineLine
	for _, e := range l.lines {
		if e.level == level && strings.Contains(e.msg, substr) {
			out = append(out, e)
		}
	}
	return out
}

// TestE2E_HandlerDeadlineStartupLog: when a subscription starts, the
// queue's handler deadline is logged with its source, with the two
// warnings: the consumer timeout cannot be determined (nothing sets one,
// so RabbitMQ's default is assumed: deadline 29 min), and
// HandlerDeadline.HandlerTimeout (40 min here) exceeds the deadline. On
// RabbitMQ 4.3+ a classic queue has no consumer timeout: no deadline, no
// warning. With BrokerConsumerTimeout given, the timeout is known.
func TestE2E_HandlerDeadlineStartupLog(t *testing.T) {
	forEachQueueType(t, func(t *testing.T, queueType string) {
		for _, known := range []bool{false, true} {
			t.Run(map[bool]string{false: "default", true: "known"}[known], func(t *testing.T) { testDeadlineStartupLog(t, queueType, known) })
		}
	})
}

func testDeadlineStartupLog(t *testing.T, queueType string, known bool) {
	log := &deadlineLog{}
	e := newEnv(t, queueType, func(c *amqpretry.Config) {
		c.Logger = log
		c.HandlerDeadline.HandlerTimeout = 40 * time.Minute
		if known {
			c.HandlerDeadline.BrokerConsumerTimeout = time.Hour
		}
	})
	e.handle("deadline", func(*message.Message) error { return nil })
	e.start()
	v, _ := e.conn.Properties["version"].(string)
	noTimeout := queueType == amqpretry.QueueTypeClassic && !strings.HasPrefix(v, "3.") &&
		!strings.HasPrefix(v, "4.0") && !strings.HasPrefix(v, "4.1") && !strings.HasPrefix(v, "4.2")
	derived := log.find("info", "Handler deadline derived")
	if len(derived) == 0 {
		t.Fatalf("known=%v: no startup log of the handler deadline", known)
	}
	f := derived[0].fields
	t.Logf("broker %s, %s queue, known=%v: %v", v, queueType, known, f)
	undetermined := log.find("info", "cannot be determined")
	tooLong := log.find("error", "Configured handler timeout exceeds")
	switch {
	case noTimeout:
		if f["handler_deadline"] != "0s" || len(undetermined) != 0 || len(tooLong) != 0 {
			t.Errorf("known=%v: classic queue on %s has no consumer timeout, yet deadline %v, %d+%d warnings", known, v, f["handler_deadline"], len(undetermined), len(tooLong))
		}
	case known:
		if f["handler_deadline"] != "59m0s" || len(undetermined) != 0 || len(tooLong) != 0 {
			t.Errorf("known: deadline %v (want 59m0s), %d+%d warnings (want none)", f["handler_deadline"], len(undetermined), len(tooLong))
		}
	default:
		if f["handler_deadline"] != "29m0s" || len(undetermined) != 1 || len(tooLong) != 1 {
			t.Errorf("unknown: deadline %v (want 29m0s), %d 'cannot be determined' and %d 'exceeds' warnings (want 1 each)", f["handler_deadline"], len(undetermined), len(tooLong))
		}
	}
}
