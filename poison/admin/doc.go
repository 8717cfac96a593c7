// Package admin inspects and repairs RabbitMQ poison queues written by
// middleware.PoisonForwarder: list and show poisoned messages, replay them to the queue
// they came from, move them to another queue, purge them selectively, and
// summarise a queue.
//
// # How a queue is read
//
// RabbitMQ has no "peek". Every operation reads the queue with basic.get and
// manual acknowledgements (noAck=false) on one dedicated channel: it first
// asks the broker for the queue's depth with a passive queue.declare
// ("Queues" guide), then fetches at most that many messages. A fetched,
// unacknowledged message is invisible to other consumers and is not
// delivered again on the same channel, so the scan sees each message at most
// once and terminates even while other messages arrive. Messages the
// operation does not remove are handed back with basic.nack requeue=true and
// the channel is closed; closing the channel (or losing the connection)
// requeues them as well ("Consumer Acknowledgements and Publisher Confirms",
// "Negative Acknowledgement and Requeuing"). The broker requeues
// asynchronously (quorum queues take a few milliseconds), so each operation
// then waits, up to 2 seconds, until the queue depth shows the messages
// again, so that the next operation sees them. A message is removed (acked)
// only after whatever had to be done with it succeeded; for Replay and Move
// that means after the broker confirmed the copy with a publisher confirm.
// Before the channel closes, a basic.get on the queue makes sure the queue
// has applied those acks: on a cluster, RabbitMQ tells a queue on another
// node about a closed channel by a route (an rpc:call through another
// delegate process) that can overtake the channel's acks, and the queue
// then requeues a message whose ack was still on its way (seen on the
// 3-node 4.3 cluster: a moved message left in the poison queue as well);
// the basic.get goes the acks' way and is answered after them.
//
// Consequences worth knowing:
//
//   - Reading is not free: a listed message comes back with the redelivered
//     flag set, and RabbitMQ may requeue it at its original position or, for
//     some queue types, at the tail.
//   - On quorum queues every read increments the message's x-delivery-count.
//     On RabbitMQ 4.0 and later that count is checked against the queue's
//     delivery limit (default 20): a message listed 20 times is dropped or
//     dead-lettered by the broker ("Quorum Queues", "Poison Message
//     Handling"). RabbitMQ 4.3 counts only basic.reject and crashes, not
//     the nacks these tools send; on 4.0-4.2 give poison queues a policy
//     with a large finite delivery-limit, e.g.
//     rabbitmqctl set_policy --apply-to quorum_queues --priority 0 poison-delivery-limit '\.poison$' '{"delivery-limit":1000000}'
//     (tested on 4.3.6: the queue's delivery_limit reads back 1000000 and
//     a message returned 25 times stays). Do not use -1 in a policy: the
//     docs said for a time that -1 is not accepted there, NServiceBus users
//     lost messages relying on it (NServiceBus.RabbitMQ issues 1688,
//     1689), a -1 policy made 4.x re-apply policies every 5 s
//     (rabbitmq-server issue 14202), and delivery-limit policy changes on
//     existing quorum queues were fixed only in 2026 (PR 16035). -1 is
//     safe only as the x-delivery-limit argument at declaration on 4.x
//     (never on 3.x, where a negative limit acts as 0), and the library
//     declares poison queues without it. RabbitMQ applies one policy per
//     queue: if another policy matches poison queues, add the key to it.
//   - Messages held unacknowledged by other consumers of the queue, and
//     messages published after the scan started, are not seen. Run one
//     operation at a time per queue and stop consumers of a poison queue
//     before repairing it.
//   - All messages of one scan are held unacknowledged until the operation
//     ends. RabbitMQ closes a channel that keeps a delivery unacknowledged
//     longer than consumer_timeout (default 30 minutes, "Delivery
//     Acknowledgement Timeout"); the operation then fails, unremoved
//     messages return to the queue, and a replayed message whose ack was lost
//     remains in the poison queue as well (a duplicate, never a loss).
//   - basic.get is one round trip per message: expect thousands of messages
//     per second, not more; the scanned messages are kept in memory.
//
// # Concurrency
//
// An Admin holds one AMQP connection. Its methods may be called from several
// goroutines, but two operations on the same queue at the same time hide
// messages from each other (see above), so results are incomplete: use it
// from one caller at a time.
//
// # Imports
//
// What it may import: amqp091-go and, of this module, poison, middleware,
// amqpwire, confirm and internal/.... Enforced by TestLayers in docs/.
package admin
