package amqpretry

import (
	"sync"
	"sync/atomic"
	"weak"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// deliveries remembers, for each message the Marshaler unmarshaled and the
// chain has not finished yet, the channel its delivery arrived on, so the
// chain can tell whether the delivery can still be acked. The chain's entry
// (Retry.Middleware) forgets the message when it returns.
//
// Why: an ack on a channel that closed (connection lost, consumer process
// killed, RabbitMQ 3.x closing the channel on consumer_timeout) or whose
// consumer the broker cancelled (RabbitMQ 4.x quorum queues on
// consumer_timeout, a deleted queue) is void: the broker has already
// returned the message to its queue ("Consumer Acknowledgements and
// Publisher Confirms", "Delivery Acknowledgement Timeout"). Publishing a
// retry or poison copy for such a delivery would fork the message.
//
// Keys are weak pointers, so a message unmarshaled but never handed to the
// chain (the subscriber was closing) does not keep its payload alive.
var deliveries sync.Map // weak.Pointer[message.Message] -> *deliveryChannel

// channels holds one deliveryChannel per AMQP channel seen, so that the
// consumer-cancel listener is registered once per channel, not per message.
var channels sync.Map // *amqp.Channel -> *deliveryChannel

type deliveryChannel struct {
	ch        *amqp.Channel
	cancelled atomic.Bool
}

// trackDelivery records the channel of d for msg.
func trackDelivery(msg *message.Message, d *amqp.Delivery) {
	ch, ok := d.Acknowledger.(*amqp.Channel)
	if !ok || ch == nil {
		return
	}
	dc, loaded := channels.Load(ch)
	if !loaded {
		fresh := &deliveryChannel{ch: ch}
		if dc, loaded = channels.LoadOrStore(ch, fresh); !loaded {
			watchChannel(fresh)
		}
	}
	deliveries.Store(weak.Make(msg), dc)
}

// watchChannel marks dc cancelled on basic.cancel from the broker and forgets
// it when the channel closes (amqp091-go closes the notify channels then).
func watchChannel(dc *deliveryChannel) {
	cancels := dc.ch.NotifyCancel(make(chan string, 1))
	go func() {
		for range cancels {
			dc.cancelled.Store(true)
		}
		channels.Delete(dc.ch)
	}()
}

// deliveryAlive reports whether msg's delivery can still be acked: false if
// its channel closed or its consumer was cancelled. Messages not unmarshaled
// by the Marshaler (gochannel, tests) count as alive.
func deliveryAlive(msg *message.Message) bool {
	v, ok := deliveries.Load(weak.Make(msg))
	if !ok {
		return true
	}
	dc := v.(*deliveryChannel)
	return !dc.ch.IsClosed() && !dc.cancelled.Load()
}

func forgetDelivery(msg *message.Message) { deliveries.Delete(weak.Make(msg)) }

// trackingMarshaler is the Marshaler the subscriber gets from
// Retry.SubscriberConfig: Marshaler plus trackDelivery.
type trackingMarshaler struct{ Marshaler }

// Unmarshal is Marshaler.Unmarshal, remembering the delivery's channel.
func (m trackingMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	msg, err := m.Marshaler.Unmarshal(d)
	if err == nil {
		trackDelivery(msg, &d)
	}
	return msg, err
}
