package audit

// Names unexported from the public API that the external tests
// (package audit_test) still reach.
var (
	UnmarshalAttempt    = unmarshalAttempt
	ArrivalFromDelivery = arrivalFromDelivery
)

const (
	DefaultResendConfirmAbove = defaultResendConfirmAbove
	SetAsideRoutingKey        = setAsideRoutingKey
	TimestampErrorProperty    = timestampErrorProperty
)

// WithDefaults is withDefaults for the external tests.
func (n Naming) WithDefaults() Naming { return n.withDefaults() }
