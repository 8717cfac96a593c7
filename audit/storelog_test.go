package audit_test

import "github.com/rabbitretry/rabbitretry/audit"

// storeLog is a Store and its DeliveryLog in one value: what the tests
// wrap to intercept both. A wrapper embedding it offers itself as the
// DeliveryLog (method DeliveryLog).
type storeLog interface {
	audit.Store
	audit.DeliveryLog
}

type deliveryLog = audit.DeliveryLog

// joined is a Store joined with its DeliveryLog.
type joined struct {
	audit.Store
	deliveryLog
}

// joinLog joins s with its DeliveryLog.
func joinLog(s interface {
	audit.Store
	DeliveryLog() audit.DeliveryLog
}) storeLog {
	return joined{s, s.DeliveryLog()}
}
