// Package cascadecore is the delay cascade's machinery behind package
// amqpretry/cascade (whose package doc describes the topology, the routing
// keys and the RabbitMQ behaviour relied upon): the configuration with its
// naming and declaring methods, the Delayer behind cascade.Mode, the
// Publisher behind cascade.NewPublisher, Waiting, the census and the
// redirect. Package cascade exposes what users call (Config, Mode,
// NewPublisher, Waiting, the errors); rabbitretry-topology's cascade
// commands, the fault suite and the benchmarks use the rest from here.
package cascadecore
