package middleware

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Observers returns an Observer that tells each of obs, in order, of every
// event: pass it as router.Config.Observer (or amqpretry.Config.Observer)
// to keep several observers at once, e.g. metrics and the audit Recorder.
// Nil entries are skipped; with no (non-nil) observers it returns
// NopObserver, with one it returns that one. Each observer's methods must be
// fast and goroutine-safe, as Observer requires: they run on the handler's
// goroutine, one after the other.
func Observers(obs ...Observer) Observer {
	var list multiObserver
	for _, o := range obs {
		if o != nil {
			list = append(list, o)
		}
	}
	switch len(list) {
	case 0:
		return NopObserver{}
	case 1:
		return list[0]
	}
	return list
}

type multiObserver []Observer

func (m multiObserver) RetryScheduled(msg *message.Message, attempt int, delay, took time.Duration) {
	for _, o := range m {
		o.RetryScheduled(msg, attempt, delay, took)
	}
}

func (m multiObserver) RetryFailed(msg *message.Message, attempt int, err error) {
	for _, o := range m {
		o.RetryFailed(msg, attempt, err)
	}
}

func (m multiObserver) Poisoned(msg *message.Message, attempt int, class string) {
	for _, o := range m {
		o.Poisoned(msg, attempt, class)
	}
}

func (m multiObserver) PoisonFailed(msg *message.Message, attempt int, err error) {
	for _, o := range m {
		o.PoisonFailed(msg, attempt, err)
	}
}

func (m multiObserver) Dropped(msg *message.Message, attempt int) {
	for _, o := range m {
		o.Dropped(msg, attempt)
	}
}

// Observer is told what the retry chain did with each failed message, e.g.
// for metrics. Methods must be fast and goroutine-safe. NopObserver ignores
// everything.
type Observer interface {
	// RetryScheduled: the copy for attempt+1 is held by the Delayer; took is
	// how long Schedule needed (the publish-with-confirm latency on AMQP).
	RetryScheduled(msg *message.Message, attempt int, delay, took time.Duration)
	// RetryFailed: the Delayer returned err; the message is being nacked.
	RetryFailed(msg *message.Message, attempt int, err error)
	// Poisoned: the message was confirmed into the poison queue.
	Poisoned(msg *message.Message, attempt int, class string)
	// PoisonFailed: the poison publish failed; the message is being nacked.
	PoisonFailed(msg *message.Message, attempt int, err error)
	// Dropped: acked and discarded on ActionDrop.
	Dropped(msg *message.Message, attempt int)
}

// NopObserver implements Observer and does nothing.
type NopObserver struct{}

// RetryScheduled does nothing.
func (NopObserver) RetryScheduled(*message.Message, int, time.Duration, time.Duration) {}

// RetryFailed does nothing.
func (NopObserver) RetryFailed(*message.Message, int, error) {}

// Poisoned does nothing.
func (NopObserver) Poisoned(*message.Message, int, string) {}

// PoisonFailed does nothing.
func (NopObserver) PoisonFailed(*message.Message, int, error) {}

// Dropped does nothing.
func (NopObserver) Dropped(*message.Message, int) {}
