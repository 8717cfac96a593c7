package middleware

// RouteObserver is an optional extension of Observer, for retry modes that
// hand a retry to the broker without a copy (amqpretry's
// DeadLetterFirstRetry: a nack that dead-letters into the first wait
// queue; NativeDelayedRetry: a nack with requeue into the queue's delayed
// state). Such a route depends on broker state an operator can change
// (a policy, a deleted or length-limited wait queue), so it is checked
// before it is relied on, at most every few seconds per queue; while it is
// broken retries take the publish path. An Observer (or one of those
// combined with Observers) that implements RouteObserver is told the
// result of each check. Like Observer's methods, RouteChecked must be fast
// and goroutine-safe: it runs on a handler's goroutine.
type RouteObserver interface {
	// RouteChecked: the route (e.g. "dead-letter-first",
	// "native-delayed-retry") of originating queue queue was checked;
	// problem is "" when it is in place, else what is wrong.
	RouteChecked(queue, route, problem string)
}

// RouteChecked tells each observer that implements RouteObserver.
func (m multiObserver) RouteChecked(queue, route, problem string) {
	for _, o := range m {
		if ro, ok := o.(RouteObserver); ok {
			ro.RouteChecked(queue, route, problem)
		}
	}
}
