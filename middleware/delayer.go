package middleware

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Delayer holds a message for at least a delay and then delivers it again to
// the consumer it came from. It is the one thing a broker must provide for
// the republisher.
//
// Schedule must return nil only when the message is safely held (for AMQP:
// the broker confirmed the publish to a wait queue, see "Consumer
// Acknowledgements and Publisher Confirms"); the republisher acks the
// original only after that. ctx is the original message's context, which
// carries the router's subscribe topic and handler name
// (message.SubscribeTopicFromCtx), from which a Delayer finds the
// originating queue. msg is a fresh copy, safe to modify.
type Delayer interface {
	Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error
}

// ErrCannotDelay marks a Delayer error that no later attempt can fix, e.g. a
// copy too large to be republished and delivered. The republisher then sends
// the message to the poison queue (class "undelayable") instead of nacking
// it, which would only bring the same message back.
var ErrCannotDelay = errors.New("message cannot be scheduled for retry")
