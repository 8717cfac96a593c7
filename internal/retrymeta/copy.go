package retrymeta

import (
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// FormatDelay renders a delay compactly, as used in wait-queue names and
// metric labels: "250ms", "1s", "90s", "5m", "2h" (whole hours, minutes or
// seconds when exact, else milliseconds, rounded down). Negative delays render
// as "0ms".
func FormatDelay(d time.Duration) string {
	d = max(d, 0)
	switch {
	case d >= time.Hour && d%time.Hour == 0:
		return strconv.FormatInt(int64(d/time.Hour), 10) + "h"
	case d >= time.Minute && d%time.Minute == 0:
		return strconv.FormatInt(int64(d/time.Minute), 10) + "m"
	case d >= time.Second && d%time.Second == 0:
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	default:
		return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
	}
}

// DefaultMaxErrorBytes is the default cap on error text copied into headers.
const DefaultMaxErrorBytes = 1024

// ErrorText turns a handler error into the text stored in headers
// (LastErrorKey, reason_poisoned): err.Error() cut to at most maxBytes bytes
// on a UTF-8 boundary, with "…" appended when cut. Error texts can contain
// secrets (URLs with credentials, tokens): configure ErrorText in the
// Republisher and PoisonForwarder configs to redact them.
func ErrorText(err error, maxBytes int) string {
	return Truncate(err.Error(), maxBytes)
}

// Truncate cuts s to at most maxBytes bytes on a UTF-8 boundary, marking a
// cut with "…". maxBytes <= 0 means no limit.
func Truncate(s string, maxBytes int) string {
	if maxBytes <= 0 || len(s) <= maxBytes {
		return s
	}
	const mark = "…"
	if maxBytes < len(mark) {
		// No room for the mark: cut without it, still within maxBytes.
		cut := maxBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		return s[:cut]
	}
	cut := maxBytes - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

// RecordFailure writes the failure metadata shared by retry copies and
// poisoned messages into md: the first failure time (set once), the last
// failure time, the error text and class, and where the message came from:
//   - OriginalQueueKey is set to queue, the queue the message was consumed
//     from, overwriting whatever md carried: a producer cannot make a replay
//     (which goes to OriginalQueueKey) deliver the message to another queue.
//     With queue "" (unknown) the key is removed.
//   - OriginalExchangeKey and OriginalRoutingKeyKey are kept as md carries
//     them only if DeliveryRetryPathKey is "true" (the delivery came back
//     through the library's own retry path, so they were written by the
//     library on an earlier failure) and OriginalExchangeKey is present.
//     Otherwise they are set from DeliveryExchangeKey and
//     DeliveryRoutingKeyKey ("" when absent), replacing values a producer may
//     have put on the message.
func RecordFailure(md message.Metadata, now time.Time, errText, class, queue string) {
	ts := now.UTC().Format(time.RFC3339Nano)
	if md.Get(FirstFailureKey) == "" {
		md.Set(FirstFailureKey, ts)
	}
	md.Set(LastFailureKey, ts)
	md.Set(LastErrorKey, errText)
	md.Set(ErrorClassKey, class)
	if _, ok := md[OriginalExchangeKey]; !ok || md.Get(DeliveryRetryPathKey) != "true" {
		md.Set(OriginalExchangeKey, md.Get(DeliveryExchangeKey))
		md.Set(OriginalRoutingKeyKey, md.Get(DeliveryRoutingKeyKey))
	}
	if queue != "" {
		md.Set(OriginalQueueKey, queue)
	} else {
		delete(md, OriginalQueueKey)
	}
}

// CloneMessage returns a new message with msg's UUID, payload and a copy of
// its metadata (delivery-only keys included: strip them with
// StripDeliveryMetadata once the failure is recorded), except
// RemainingDelayKey: the Delayer that schedules the copy writes it anew if
// it cannot hold the copy's whole delay. The copy has a background context
// and no ack state of its own.
func CloneMessage(msg *message.Message) *message.Message {
	c := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if k != RemainingDelayKey {
			c.Metadata[k] = v
		}
	}
	return c
}
