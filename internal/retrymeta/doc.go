// Package retrymeta is the library's one metadata vocabulary: every metadata
// key (and AMQP header) the retry chain writes or reads is defined in
// keys.go, once, with the one strip predicate every copy path uses
// (IsDeliveryOnly, StripDeliveryMetadata) and the replay predicate
// (IsRetryState). It also holds the helpers the chain's packages share to
// make copies (CloneMessage, RecordFailure, ErrorText), the context values a
// Delayer reads (MinimumDelay, CopyRequired) and BackoffDelay.
//
// It is internal so that the public API stays small: package middleware
// re-exports, in metadata.go, the keys and functions users read or call
// (AttemptKey, ErrorClassKey, IsRetryState, MinimumDelay, ...), each as an
// alias of the definition here; the keys that describe one delivery or carry
// the chain's own bookkeeping stay here, used by middleware, router,
// amqpretry, audit and poison/admin.
//
// It imports only Watermill and the standard library.
package retrymeta
