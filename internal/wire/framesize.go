package wire

import (
	"cmp"
	"slices"
	"strings"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// MaxCopyHeaderBytes is the largest encoded size, in bytes, of the headers of
// a retry or poison copy: RabbitMQ's default frame_max (131,072 bytes,
// "Networking and RabbitMQ") minus 8 KiB kept for the other properties and for
// the x-death header the broker adds when it dead-letters the copy. All
// headers travel in one content-header frame, and amqp091-go closes the
// connection on a frame above frame_max, so a larger copy would come back as
// an undeliverable message that resets the consumer's connection in a loop.
// The Delayer refuses such a copy (middleware.ErrCannotDelay, so the message
// is poisoned instead) and the poison publisher drops its largest user headers
// until it fits (listing them under DroppedHeadersKey).
const MaxCopyHeaderBytes = 131072 - 8192

// HeaderBytes returns the size of h encoded as an AMQP field table,
// as amqp091-go writes it: a 4-byte length, then per entry a 1-byte name
// length, the name and the tagged value (see FieldSize; typed values, which
// Marshal restores from TypedHeadersKey, count with their AMQP encoding).
func HeaderBytes(h amqp.Table) int {
	n := 4
	for k, v := range h {
		n += 1 + len(k) + FieldSize(v)
	}
	return n
}

// keptWhenTrimming reports headers the poison publisher never drops: the
// message UUID and the failure metadata.
func keptWhenTrimming(k string) bool {
	return k == wamqp.DefaultMessageUUIDHeaderKey || strings.HasPrefix(k, "rabbitretry-") || strings.HasSuffix(k, "_poisoned")
}

// FitHeaders drops the largest user headers of p until its headers fit
// MaxCopyHeaderBytes, recording their names under DroppedHeadersKey.
func FitHeaders(p *amqp.Publishing) {
	if HeaderBytes(p.Headers) <= MaxCopyHeaderBytes {
		return
	}
	keys := make([]string, 0, len(p.Headers))
	for k := range p.Headers {
		if !keptWhenTrimming(k) {
			keys = append(keys, k)
		}
	}
	size := func(k string) int { return len(k) + FieldSize(p.Headers[k]) }
	slices.SortFunc(keys, func(a, b string) int { return cmp.Compare(size(b), size(a)) })
	var dropped []string
	for _, k := range keys {
		if HeaderBytes(p.Headers) <= MaxCopyHeaderBytes {
			break
		}
		delete(p.Headers, k)
		dropped = append(dropped, k)
	}
	if len(dropped) > 0 {
		p.Headers[retrymeta.DroppedHeadersKey] = retrymeta.Truncate(strings.Join(dropped, ","), 1024)
	}
}
