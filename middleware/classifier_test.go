package middleware_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/middleware"
)

func jsonSyntaxErr(t *testing.T) error {
	t.Helper()
	var v map[string]any
	err := json.Unmarshal([]byte(`{"a": 1,,}`), &v)
	var se *json.SyntaxError
	if !errors.As(err, &se) {
		t.Fatalf("expected *json.SyntaxError, got %T %v", err, err)
	}
	return err
}

func jsonTypeErr(t *testing.T) error {
	t.Helper()
	var v struct {
		N int `json:"n"`
	}
	err := json.Unmarshal([]byte(`{"n": "not a number"}`), &v)
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		t.Fatalf("expected *json.UnmarshalTypeError, got %T %v", err, err)
	}
	return err
}

func jsonInvalidUnmarshalErr(t *testing.T) error {
	t.Helper()
	var v *struct{}
	err := json.Unmarshal([]byte(`{}`), v) // a nil pointer
	var ie *json.InvalidUnmarshalError
	if !errors.As(err, &ie) {
		t.Fatalf("expected *json.InvalidUnmarshalError, got %T %v", err, err)
	}
	return err
}

type myErr struct{ code int }

func (e *myErr) Error() string { return fmt.Sprintf("my error %d", e.code) }

func TestDefaultClassifier(t *testing.T) {
	base := errors.New("boom")
	tests := []struct {
		name   string
		err    error
		action middleware.Action
		class  string
		delay  time.Duration
	}{
		{"plain error is transient", base, middleware.ActionRetry, middleware.ClassTransient, 0},
		{"permanent", middleware.Permanent(base), middleware.ActionPoison, middleware.ClassPermanent, 0},
		{"wrapped permanent", fmt.Errorf("ctx: %w", middleware.Permanent(base)), middleware.ActionPoison, middleware.ClassPermanent, 0},
		{"drop", middleware.Drop(base), middleware.ActionDrop, middleware.ClassDropped, 0},
		{"wrapped drop", fmt.Errorf("ctx: %w", middleware.Drop(base)), middleware.ActionDrop, middleware.ClassDropped, 0},
		{"retry after", middleware.RetryAfter(base, 3*time.Second), middleware.ActionRetry, middleware.ClassRetryAfter, 3 * time.Second},
		{"wrapped retry after", fmt.Errorf("http 429: %w", middleware.RetryAfter(base, 250*time.Millisecond)), middleware.ActionRetry, middleware.ClassRetryAfter, 250 * time.Millisecond},
		{"retry after zero means backoff", middleware.RetryAfter(base, 0), middleware.ActionRetry, middleware.ClassTransient, 0},
		{"retry after negative means backoff", middleware.RetryAfter(base, -time.Second), middleware.ActionRetry, middleware.ClassTransient, 0},
		{"json syntax error", jsonSyntaxErr(t), middleware.ActionPoison, middleware.ClassMalformed, 0},
		{"wrapped json syntax error", fmt.Errorf("decode order: %w", jsonSyntaxErr(t)), middleware.ActionPoison, middleware.ClassMalformed, 0},
		{"json type error", jsonTypeErr(t), middleware.ActionPoison, middleware.ClassMalformed, 0},
		{"wrapped json type error", fmt.Errorf("decode: %w", jsonTypeErr(t)), middleware.ActionPoison, middleware.ClassMalformed, 0},
		{"json invalid unmarshal", jsonInvalidUnmarshalErr(t), middleware.ActionPoison, middleware.ClassMalformed, 0},
		{"context canceled", context.Canceled, middleware.ActionRetry, middleware.ClassTransient, 0},
		{"wrapped context canceled", fmt.Errorf("query: %w", context.Canceled), middleware.ActionRetry, middleware.ClassTransient, 0},
		{"deadline exceeded", context.DeadlineExceeded, middleware.ActionRetry, middleware.ClassTransient, 0},
		// First match wins: Drop is checked before Permanent.
		{"drop of permanent", middleware.Drop(middleware.Permanent(base)), middleware.ActionDrop, middleware.ClassDropped, 0},
		{"permanent of retry after", middleware.Permanent(middleware.RetryAfter(base, time.Second)), middleware.ActionPoison, middleware.ClassPermanent, 0},
		{"permanent json error", middleware.Permanent(jsonSyntaxErr(t)), middleware.ActionPoison, middleware.ClassPermanent, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := middleware.DefaultClassifier.Classify(tc.err)
			want := middleware.Classification{Action: tc.action, Class: tc.class, Delay: tc.delay}
			if got != want {
				t.Fatalf("Classify(%v) = %+v, want %+v", tc.err, got, want)
			}
		})
	}
}

func TestMarkersOfNilAreNil(t *testing.T) {
	if middleware.Permanent(nil) != nil || middleware.Drop(nil) != nil || middleware.RetryAfter(nil, time.Second) != nil {
		t.Fatal("markers of nil must be nil")
	}
	if middleware.IsPermanent(errors.New("x")) || middleware.IsDrop(errors.New("x")) {
		t.Fatal("plain error reported as marked")
	}
	if d := middleware.DefaultClassifier.Classify(errors.New("x")).Delay; d != 0 {
		t.Fatalf("a plain error asks for delay %v", d)
	}
	base := errors.New("root cause")
	for _, err := range []error{middleware.Permanent(base), middleware.Drop(base), middleware.RetryAfter(base, time.Second)} {
		if !errors.Is(err, base) {
			t.Errorf("%T does not unwrap to its cause", err)
		}
		if !strings.Contains(err.Error(), "root cause") {
			t.Errorf("%T text %q lost the cause", err, err.Error())
		}
	}
	if got := middleware.RetryAfter(base, 2*time.Second).Error(); !strings.Contains(got, "2s") {
		t.Errorf("RetryAfter text %q does not mention the delay", got)
	}
}

func TestActionString(t *testing.T) {
	for a, want := range map[middleware.Action]string{
		middleware.ActionRetry: "retry", middleware.ActionPoison: "poison", middleware.ActionDrop: "drop", middleware.Action(9): "Action(9)",
	} {
		if got := a.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int(a), got, want)
		}
	}
}

func TestClassifierCustomRules(t *testing.T) {
	errA := errors.New("A")
	c, err := middleware.NewClassifier(middleware.ClassifierConfig{Rules: []middleware.Rule{
		{Class: "a-first", Match: middleware.MatchIs(errA), Action: middleware.ActionPoison},
		{Class: "a-second", Match: middleware.MatchIs(errA), Action: middleware.ActionDrop},
		{Class: "mine", Match: middleware.MatchAs[*myErr](), Action: middleware.ActionDrop},
		// Custom rules run before the defaults: this overrides "permanent".
		{Class: "permanent-but-retried", Match: middleware.IsPermanent, Action: middleware.ActionRetry},
	}})
	if err != nil {
		t.Fatal(err)
	}
	check := func(err error, want middleware.Classification) {
		t.Helper()
		if got := c.Classify(err); got != want {
			t.Errorf("Classify(%v) = %+v, want %+v", err, got, want)
		}
	}
	check(errA, middleware.Classification{Action: middleware.ActionPoison, Class: "a-first"})
	check(fmt.Errorf("wrapped: %w", errA), middleware.Classification{Action: middleware.ActionPoison, Class: "a-first"})
	check(&myErr{code: 7}, middleware.Classification{Action: middleware.ActionDrop, Class: "mine"})
	check(fmt.Errorf("wrapped: %w", &myErr{code: 7}), middleware.Classification{Action: middleware.ActionDrop, Class: "mine"})
	check(middleware.Permanent(errors.New("x")), middleware.Classification{Action: middleware.ActionRetry, Class: "permanent-but-retried"})
	// Defaults still apply after the custom rules.
	check(jsonSyntaxErr(t), middleware.Classification{Action: middleware.ActionPoison, Class: middleware.ClassMalformed})
	check(errors.New("other"), middleware.Classification{Action: middleware.ActionRetry, Class: middleware.ClassTransient})
	// A custom retry rule carries a RetryAfter delay.
	check(middleware.Permanent(middleware.RetryAfter(errors.New("x"), time.Minute)),
		middleware.Classification{Action: middleware.ActionRetry, Class: "permanent-but-retried", Delay: time.Minute})
}

func TestClassifierNoDefaultRulesAndDefault(t *testing.T) {
	c, err := middleware.NewClassifier(middleware.ClassifierConfig{
		NoDefaultRules: true,
		Rules:          []middleware.Rule{{Class: "timeout", Match: middleware.MatchIs(context.DeadlineExceeded), Action: middleware.ActionRetry}},
		Default:        middleware.ActionPoison,
		DefaultClass:   "unknown",
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Classify(middleware.Drop(errors.New("x"))); got != (middleware.Classification{Action: middleware.ActionPoison, Class: "unknown"}) {
		t.Errorf("without default rules Drop must fall to Default, got %+v", got)
	}
	if got := c.Classify(jsonSyntaxErr(t)); got.Class != "unknown" {
		t.Errorf("without default rules a JSON error must fall to Default, got %+v", got)
	}
	if got := c.Classify(context.DeadlineExceeded); got != (middleware.Classification{Action: middleware.ActionRetry, Class: "timeout"}) {
		t.Errorf("custom rule: got %+v", got)
	}
	// Default ActionPoison never carries a delay.
	if got := c.Classify(middleware.RetryAfter(errors.New("x"), time.Second)); got.Delay != 0 || got.Action != middleware.ActionPoison {
		t.Errorf("got %+v", got)
	}

	// Default retry with NoDefaultRules keeps a RetryAfter delay.
	c2, err := middleware.NewClassifier(middleware.ClassifierConfig{NoDefaultRules: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := c2.Classify(middleware.RetryAfter(errors.New("x"), time.Second)); got != (middleware.Classification{Action: middleware.ActionRetry, Class: middleware.ClassTransient, Delay: time.Second}) {
		t.Errorf("got %+v", got)
	}
}

func TestClassifierAlreadyClassifiedKeepsClassification(t *testing.T) {
	pre := &middleware.ClassifiedError{
		Err:            middleware.Permanent(errors.New("x")),
		Classification: middleware.Classification{Action: middleware.ActionRetry, Class: "custom", Delay: 5 * time.Second},
	}
	wrapped := fmt.Errorf("outer: %w", pre)
	if got := middleware.DefaultClassifier.Classify(wrapped); got != pre.Classification {
		t.Fatalf("got %+v, want %+v", got, pre.Classification)
	}
	_, err := middleware.DefaultClassifier.Middleware(failWith(wrapped))(newMsg("p"))
	var ce *middleware.ClassifiedError
	if !errors.As(err, &ce) || ce != pre {
		t.Fatalf("middleware must keep the existing *ClassifiedError, got %T %v", err, err)
	}
}

func TestClassifierConfigValidate(t *testing.T) {
	match := func(error) bool { return true }
	tests := []struct {
		name string
		cfg  middleware.ClassifierConfig
		want string
	}{
		{"match nil", middleware.ClassifierConfig{Rules: []middleware.Rule{{Class: "a"}}}, "Rules[0].Match"},
		{"class empty", middleware.ClassifierConfig{Rules: []middleware.Rule{{Class: "a", Match: match}, {Match: match}}}, "Rules[1].Class"},
		{"unknown action", middleware.ClassifierConfig{Rules: []middleware.Rule{{Class: "a", Match: match, Action: middleware.Action(7)}}}, "Rules[0].Action"},
		{"negative action", middleware.ClassifierConfig{Rules: []middleware.Rule{{Class: "a", Match: match, Action: middleware.Action(-1)}}}, "Rules[0].Action"},
		{"unknown default", middleware.ClassifierConfig{Default: middleware.Action(3)}, "ClassifierConfig.Default"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want an error naming %q", err, tc.want)
			}
			c, err2 := middleware.NewClassifier(tc.cfg)
			if c != nil || err2 == nil || !strings.Contains(err2.Error(), tc.want) {
				t.Fatalf("NewClassifier() = %v, %v; want nil and an error naming %q", c, err2, tc.want)
			}
		})
	}
	if err := (middleware.ClassifierConfig{Rules: []middleware.Rule{{Class: "a", Match: match, Action: middleware.ActionDrop}}}).Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
}

type dropObserver struct {
	middleware.NopObserver
	mu       sync.Mutex
	dropped  []string
	attempts []int
}

func (o *dropObserver) Dropped(msg *message.Message, attempt int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.dropped = append(o.dropped, msg.UUID)
	o.attempts = append(o.attempts, attempt)
}

func TestClassifierMiddleware(t *testing.T) {
	logger := watermill.NewCaptureLogger()
	obs := &dropObserver{}
	c, err := middleware.NewClassifier(middleware.ClassifierConfig{Logger: logger, Observer: obs})
	if err != nil {
		t.Fatal(err)
	}

	t.Run("success passes produced messages", func(t *testing.T) {
		produced := []*message.Message{newMsg("out")}
		out, err := c.Middleware(func(*message.Message) ([]*message.Message, error) { return produced, nil })(newMsg("in"))
		if err != nil || len(out) != 1 || out[0] != produced[0] {
			t.Fatalf("got %v, %v", out, err)
		}
	})

	t.Run("error is wrapped with its classification", func(t *testing.T) {
		cause := middleware.Permanent(errors.New("bad"))
		_, err := c.Middleware(failWith(cause))(newMsg("in"))
		var ce *middleware.ClassifiedError
		if !errors.As(err, &ce) {
			t.Fatalf("got %T %v, want *ClassifiedError", err, err)
		}
		if ce.Action != middleware.ActionPoison || ce.Class != middleware.ClassPermanent {
			t.Fatalf("got %+v", ce.Classification)
		}
		if !errors.Is(err, cause) || err.Error() != cause.Error() {
			t.Fatalf("wrapped error lost its cause: %v", err)
		}
	})

	t.Run("retry after delay carried", func(t *testing.T) {
		_, err := c.Middleware(failWith(middleware.RetryAfter(errors.New("429"), 42*time.Second)))(newMsg("in"))
		var ce *middleware.ClassifiedError
		if !errors.As(err, &ce) || ce.Delay != 42*time.Second || ce.Class != middleware.ClassRetryAfter || ce.Action != middleware.ActionRetry {
			t.Fatalf("got %v", err)
		}
	})

	t.Run("drop acks with no messages", func(t *testing.T) {
		msg := newMsg("in")
		msg.SetContext(middleware.ContextWithAttempt(msg.Context(), 3))
		out, err := c.Middleware(func(*message.Message) ([]*message.Message, error) {
			return []*message.Message{newMsg("produced before failing")}, middleware.Drop(errors.New("obsolete"))
		})(msg)
		if err != nil || out != nil {
			t.Fatalf("drop must return nil, nil; got %v, %v", out, err)
		}
		obs.mu.Lock()
		defer obs.mu.Unlock()
		if len(obs.dropped) != 1 || obs.dropped[0] != msg.UUID || obs.attempts[0] != 3 {
			t.Fatalf("observer saw drops %v attempts %v", obs.dropped, obs.attempts)
		}
		infos := logger.Captured()[watermill.InfoLogLevel]
		if len(infos) != 1 || infos[0].Fields["message_uuid"] != msg.UUID || infos[0].Fields["attempt"] != 3 {
			t.Fatalf("expected one Info log for the drop, got %+v", infos)
		}
	})
}
