package cascadecore

import (
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// dueHeader is the header the Delayer and the Publisher stamp on every
// message they publish to the cascade: the absolute time the message is
// due at its destination, in Unix milliseconds (a decimal string, so it
// travels as plain Watermill metadata): publish time + the delay rounded up
// to the grain. It lets Census take a message out of a level queue and put
// it back with exactly its remaining delay. The consumer sees it as
// metadata (like the x-death headers the levels add); a new Schedule
// overwrites it. Messages published by versions without it are still
// delivered; Census then bounds their remaining delay (see Census).
const dueHeader = "rabbitretry-cascade-due"

// censusHeader marks a message Census put back into the cascade, with the
// census run's id, so that the same run, reaching it again at the tail of a
// level queue, knows it has gone round the whole queue and stops there
// (it does not count it twice). Later runs ignore other runs' ids; a new
// Schedule removes it.
const censusHeader = "rabbitretry-cascade-census"

// headerBytes estimates the size of h encoded as an AMQP field table (a
// 4-byte length, then per entry a 1-byte name length, the name and the
// tagged value), as amqp091-go writes it.
func headerBytes(h amqp.Table) int {
	n := 4
	for k, v := range h {
		n += 1 + len(k) + fieldBytes(v)
	}
	return n
}

// fieldBytes is the encoded size of one tagged field value, tag included.
func fieldBytes(v any) int {
	switch v := v.(type) {
	case nil:
		return 1
	case bool, int8, uint8:
		return 2
	case int16, uint16:
		return 3
	case int32, uint32, float32:
		return 5
	case int, int64, uint64, float64, time.Time:
		return 9
	case amqp.Decimal:
		return 6
	case string:
		return 5 + len(v)
	case []byte:
		return 5 + len(v)
	case amqp.Table:
		return 1 + headerBytes(v)
	case []any:
		n := 5
		for _, e := range v {
			n += fieldBytes(e)
		}
		return n
	default:
		return 64 // unknown to this estimate: amqp091-go refuses it anyway
	}
}
