package audit

// Names unexported from the public API that the external tests
// (package audit_test) still reach.
var (
	UnmarshalAttempt    = unmarshalAttempt
	ArrivalFromDelivery = arrivalFromDelivery
	MarshalAttempt      = marshalAttempt
	ErrResenderClosed   = errResenderClosed
)

const (
	DefaultResendConfirmAbove = defaultResendConfirmAbove
	SetAsideRoutingKey        = setAsideRoutingKey
	TimestampErrorProperty    = timestampErrorProperty
	AttemptRoutingKey         = attemptRoutingKey
	DefaultUUIDHeader         = defaultUUIDHeader
	DefaultBatchSize          = defaultBatchSize
	DefaultLoopBackExchange   = defaultLoopBackExchange
	DefaultResendLimit        = defaultResendLimit
	MaxResendLimit            = maxResendLimit
	QueueTypeQuorum           = queueTypeQuorum
	QueueTypeClassic          = queueTypeClassic
	DeliveryLimit             = deliveryLimit
)

// WithDefaults is withDefaults for the external tests.
func (n Naming) WithDefaults() Naming { return n.withDefaults() }
