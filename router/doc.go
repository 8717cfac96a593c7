// Package router assembles the retry middlewares in the one correct order and
// plugs them into a Watermill *message.Router.
//
// From the outside in:
//
//	[Tracing]            optional: one OpenTelemetry span per attempt
//	AttemptCounter       sets the attempt number before anything reads it
//	  fallback             settles what nothing further in could: pause, copy back
//	                       to the origin queue (confirmed), else nack with requeue
//	    PoisonForwarder      poisons permanent and exhausted failures (confirmed, then ack)
//	      RedeliveryGuard      a delivery back before its whole delay is held again;
//	                           a redelivered message is not run: a counted copy is
//	                           requeued, or moved to the quarantine queue (confirmed,
//	                           then ack); at the limit, poisoned
//	        Republisher          past MaxAttempts: poisoned without running; otherwise
//	                             schedules retries through the Delayer (confirmed, then ack)
//	          Classifier           wraps the handler error with retry / poison / drop,
//	                               or nack when the delivery was already given back
//	            [Pause]              optional: holds messages, uncharged, while a
//	                                 dependency is down; probes, then resumes
//	            [Recoverer, Timeout, ...]  Watermill middlewares that turn panics and
//	                                       deadlines into errors go inside the chain
//	              handler
//
// The counter is outermost so every inner layer sees the same attempt. The
// classifier is innermost so every layer acts on its verdict. The forwarder
// wraps the guard and the republisher because both turn "no more tries" into
// an error it poisons. The fallback wraps the forwarder because a failed
// poison publish is one of the two failures it settles (the other is a
// retry the Delayer could not hold).
//
// Every message that enters the chain ends exactly one way: acked after
// success (or a Drop); acked after its retry copy was held by the Delayer
// (for AMQP: confirmed by the broker); acked after its poison copy was
// confirmed; or, when no copy could be held, nacked with requeue after a
// pause, so it stays in its queue. Nothing is acked before the copy that
// replaces it is confirmed.
//
// # Imports
//
// What it may import: Watermill, backoff and, of this module, middleware (and
// poison, whose forwarder the chain wraps); no AMQP client: the broker's
// attempt sources come from the transport (amqpretry.New passes
// amqpwire.Sources). Enforced by TestLayers in docs/.
package router
