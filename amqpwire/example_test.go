package amqpwire_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// A handler reads the broker's x-death header, which the amqpretry
// Marshaler gives it as JSON under middleware.XDeathKey.
func ExampleParseXDeath() {
	msg := message.NewMessage("uuid-1", nil)
	msg.Metadata.Set(middleware.XDeathKey,
		`[{"queue":"orders","reason":"rejected","count":2,"exchange":"","routing-keys":["orders"]}]`)

	recs, err := amqpwire.ParseXDeath(msg.Metadata.Get(middleware.XDeathKey))
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range recs {
		fmt.Printf("%s %s %d %v\n", r.Queue, r.Reason, r.Count, r.RoutingKeys)
	}
	// Output: orders rejected 2 [orders]
}
