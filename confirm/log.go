package confirm

import (
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
)

// asyncLog hands log entries to the user's logger from one goroutine of its
// own, so no path of the publisher ever waits for the logger. When
// logQueueSize entries are waiting, new ones are dropped and counted.
type asyncLog struct {
	l       watermill.LoggerAdapter
	q       chan logEntry
	done    chan struct{}
	once    sync.Once
	dropped atomic.Int64
}

type logEntry struct {
	level  int // 0 debug, 1 info, 2 error
	msg    string
	err    error
	fields watermill.LogFields
}

func newAsyncLog(l watermill.LoggerAdapter) *asyncLog {
	a := &asyncLog{l: l, q: make(chan logEntry, logQueueSize), done: make(chan struct{})}
	go a.run()
	return a
}

func (a *asyncLog) run() {
	for {
		select {
		case e := <-a.q:
			a.emit(e)
		case <-a.done:
			for {
				select {
				case e := <-a.q:
					a.emit(e)
				default:
					return
				}
			}
		}
	}
}

func (a *asyncLog) emit(e logEntry) {
	if n := a.dropped.Swap(0); n > 0 {
		e.fields = e.fields.Add(watermill.LogFields{"log_entries_dropped": n})
	}
	switch e.level {
	case 0:
		a.l.Debug(e.msg, e.fields)
	case 1:
		a.l.Info(e.msg, e.fields)
	default:
		a.l.Error(e.msg, e.err, e.fields)
	}
}

func (a *asyncLog) put(e logEntry) {
	select {
	case a.q <- e:
	default:
		a.dropped.Add(1)
	}
}

func (a *asyncLog) debug(msg string, f watermill.LogFields) { a.put(logEntry{0, msg, nil, f}) }
func (a *asyncLog) info(msg string, f watermill.LogFields)  { a.put(logEntry{1, msg, nil, f}) }
func (a *asyncLog) error(msg string, err error, f watermill.LogFields) {
	a.put(logEntry{2, msg, err, f})
}

// stop lets the goroutine emit what is queued and end.
func (a *asyncLog) stop() { a.once.Do(func() { close(a.done) }) }
