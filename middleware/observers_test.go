package middleware_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/middleware"
)

type logObserver struct {
	name string
	log  *[]string
}

func (o logObserver) RetryScheduled(msg *message.Message, attempt int, delay, took time.Duration) {
	*o.log = append(*o.log, fmt.Sprintf("%s retry %s %d %v", o.name, msg.UUID, attempt, delay))
}
func (o logObserver) RetryFailed(msg *message.Message, attempt int, err error) {
	*o.log = append(*o.log, fmt.Sprintf("%s retryfailed %s %d %v", o.name, msg.UUID, attempt, err))
}
func (o logObserver) Poisoned(msg *message.Message, attempt int, class string) {
	*o.log = append(*o.log, fmt.Sprintf("%s poisoned %s %d %s", o.name, msg.UUID, attempt, class))
}
func (o logObserver) PoisonFailed(msg *message.Message, attempt int, err error) {
	*o.log = append(*o.log, fmt.Sprintf("%s poisonfailed %s %d %v", o.name, msg.UUID, attempt, err))
}
func (o logObserver) Dropped(msg *message.Message, attempt int) {
	*o.log = append(*o.log, fmt.Sprintf("%s dropped %s %d", o.name, msg.UUID, attempt))
}

func TestObserversFanOutInOrder(t *testing.T) {
	var log []string
	obs := middleware.Observers(logObserver{"a", &log}, nil, logObserver{"b", &log})
	msg := message.NewMessage("m1", nil)
	obs.RetryScheduled(msg, 1, time.Second, time.Millisecond)
	obs.RetryFailed(msg, 2, errors.New("refused"))
	obs.Poisoned(msg, 3, "permanent")
	obs.PoisonFailed(msg, 4, errors.New("nacked"))
	obs.Dropped(msg, 5)
	want := []string{
		"a retry m1 1 1s", "b retry m1 1 1s",
		"a retryfailed m1 2 refused", "b retryfailed m1 2 refused",
		"a poisoned m1 3 permanent", "b poisoned m1 3 permanent",
		"a poisonfailed m1 4 nacked", "b poisonfailed m1 4 nacked",
		"a dropped m1 5", "b dropped m1 5",
	}
	if fmt.Sprint(log) != fmt.Sprint(want) {
		t.Fatalf("events\n got %q\nwant %q", log, want)
	}
}

func TestObserversDegenerate(t *testing.T) {
	if _, ok := middleware.Observers().(middleware.NopObserver); !ok {
		t.Errorf("Observers() is %T, want NopObserver", middleware.Observers())
	}
	if _, ok := middleware.Observers(nil, nil).(middleware.NopObserver); !ok {
		t.Errorf("Observers(nil, nil) is not NopObserver")
	}
	var log []string
	one := logObserver{"a", &log}
	if got := middleware.Observers(nil, one); got != middleware.Observer(one) {
		t.Errorf("Observers(nil, x) = %v, want x itself", got)
	}
}
