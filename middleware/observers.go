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
