// Package amqperr reads what a RabbitMQ refusal says, for the packages
// that wrap refused declares (amqpretry's DeclareError, used by amqpretry
// and the delay cascade).
package amqperr

import (
	"errors"
	"regexp"

	amqp "github.com/rabbitmq/amqp091-go"
)

var (
	inequivalentArg = regexp.MustCompile(`inequivalent arg '([^']+)'`)
	// "received none but current is the value '1000' of type 'long'"
	inequivalentValues = regexp.MustCompile(`received (none|the value '[^']*' of type '[^']*') but current is (none|the value '[^']*' of type '[^']*')`)
)

// Inequivalent reads a 406 PRECONDITION_FAILED refusal of a redeclare with
// other arguments ("inequivalent arg 'x-…' for queue '…' in vhost '/':
// received … but current is …"): the argument's name and, when the broker
// gives them, the value declared now (wanted) and the existing one (found),
// each "none" or "the value '…' of type '…'". arg is "" for any other error.
func Inequivalent(err error) (arg, wanted, found string) {
	var aerr *amqp.Error
	if !errors.As(err, &aerr) || aerr.Code != amqp.PreconditionFailed {
		return "", "", ""
	}
	m := inequivalentArg.FindStringSubmatch(aerr.Reason)
	if m == nil {
		return "", "", ""
	}
	if v := inequivalentValues.FindStringSubmatch(aerr.Reason); v != nil {
		return m[1], v[1], v[2]
	}
	return m[1], "", ""
}
