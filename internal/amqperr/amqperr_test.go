package amqperr

import (
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestInequivalent(t *testing.T) {
	for _, tc := range []struct {
		err                error
		arg, wanted, found string
	}{
		{&amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received the value '2000' of type 'long' but current is the value '1000' of type 'long'"},
			"x-message-ttl", "the value '2000' of type 'long'", "the value '1000' of type 'long'"},
		{&amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received the value '5' of type 'long' but current is none"},
			"x-delivery-limit", "the value '5' of type 'long'", "none"},
		{&amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'durable'"}, "durable", "", ""},
		{&amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no queue 'q' in vhost '/'"}, "", "", ""},
		{errors.New("inequivalent arg 'x'"), "", "", ""},
	} {
		arg, wanted, found := Inequivalent(tc.err)
		if arg != tc.arg || wanted != tc.wanted || found != tc.found {
			t.Errorf("Inequivalent(%v) = %q, %q, %q; want %q, %q, %q", tc.err, arg, wanted, found, tc.arg, tc.wanted, tc.found)
		}
	}
}
