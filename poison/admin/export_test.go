package admin

import amqp "github.com/rabbitmq/amqp091-go"

// NewNamed is New with the client-provided connection name, so a test can
// find its own connection in rabbitmqctl list_connections and close it
// without touching other tests' connections.
func NewNamed(cfg Config, name string) (*Admin, error) { return newAdmin(cfg, name) }

// SetHook installs f as a's step hook: Replay, Move and Purge call it at
// each step (see the calls of Admin.at) with the number of matched
// messages handled so far. Set it before the operation starts.
func SetHook(a *Admin, f func(step string, done int)) { a.hook = f }

// MessageFromDelivery is messageFromDelivery, for the tests.
func MessageFromDelivery(d amqp.Delivery) Message { return messageFromDelivery(d) }

// FilterMatch is Filter.match, for the tests.
func FilterMatch(f Filter, m Message) bool { return f.match(m) }

// FilterValidate is Filter.validate, for the tests.
func FilterValidate(f Filter) error { return f.validate() }
