package amqpretry

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// lazyDeadlineCtx behaves as context.WithDeadline(parent, deadline) but
// creates that context (and its timer) only when it is needed: when
// someone asks for Done or Err, or for the context package's own key
// (context.Cause, context.AfterFunc and a child's cancel propagation look
// it up). A handler that never looks at its context, the healthy path's
// usual case, so costs one small allocation instead of a timer, a
// cancelCtx and a child registration in its parent (and, measured with
// BenchmarkHealthyPath, a stack copy per message: context.WithDeadline's
// frames pushed the handler goroutine past its first 2 KB stack).
//
// Deadline and Value answer without creating it, as the real one would
// (Value of any other key reads the parent either way).
type lazyDeadlineCtx struct {
	context.Context // the parent
	deadline        time.Time
	timeout         time.Duration // the handler deadline it was made for (logs)

	inner atomic.Pointer[lazyInner] // set once, under mu

	mu        sync.Mutex
	cancelled bool // stop ran before inner was made
}

type lazyInner struct {
	ctx    context.Context
	cancel context.CancelFunc
}

// newLazyDeadline returns the context for deadline; its parent (Context)
// must be set before use.
func newLazyDeadline(deadline time.Time) *lazyDeadlineCtx {
	return &lazyDeadlineCtx{deadline: deadline}
}

// Deadline is the earlier of the parent's deadline and this one, as with
// context.WithDeadline.
func (c *lazyDeadlineCtx) Deadline() (time.Time, bool) {
	if d, ok := c.Context.Deadline(); ok && d.Before(c.deadline) {
		return d, true
	}
	return c.deadline, true
}

func (c *lazyDeadlineCtx) Done() <-chan struct{} { return c.get().Done() }

func (c *lazyDeadlineCtx) Err() error { return c.get().Err() }

func (c *lazyDeadlineCtx) Value(key any) any {
	if _, ok := key.(*int); ok {
		// The context package's &cancelCtxKey (an *int): whoever asks
		// wants the real cancelCtx.
		return c.get().Value(key)
	}
	if in := c.inner.Load(); in != nil {
		return in.ctx.Value(key)
	}
	return c.Context.Value(key)
}

func (c *lazyDeadlineCtx) String() string { return "amqpretry.handlerDeadline" }

func (c *lazyDeadlineCtx) get() context.Context {
	if in := c.inner.Load(); in != nil {
		return in.ctx
	}
	return c.make()
}

// make creates the real context; after stop, an already cancelled one
// (Canceled, or the parent's error: the one difference from
// context.WithDeadline is that a handler that overran its deadline without
// ever looking at its context leaves one that says Canceled, not
// DeadlineExceeded, to whoever first looks at it after the handler
// returned; stop reads no clock, to stay cheap on the handler goroutine's
// deepest frames).
//
//go:noinline
func (c *lazyDeadlineCtx) make() context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if in := c.inner.Load(); in != nil {
		return in.ctx
	}
	in := &lazyInner{}
	if c.cancelled {
		in.ctx, in.cancel = context.WithCancel(c.Context)
		in.cancel()
	} else {
		in.ctx, in.cancel = context.WithDeadline(c.Context, c.deadline)
	}
	c.inner.Store(in)
	return in.ctx
}

// stop is the CancelFunc: it releases the timer if one was made, and
// otherwise fixes what Err will say if the context is looked at later.
func (c *lazyDeadlineCtx) stop() {
	if in := c.inner.Load(); in != nil {
		in.cancel()
		return
	}
	c.stopSlow()
}

//go:noinline
func (c *lazyDeadlineCtx) stopSlow() {
	c.mu.Lock()
	in := c.inner.Load()
	if in == nil {
		c.cancelled = true
	}
	c.mu.Unlock()
	if in != nil {
		in.cancel()
	}
}
