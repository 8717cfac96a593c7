package cascade

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/cascadecore"
)

// TestConfigMatchesCore: Config has the exported fields of
// cascadecore.Config, same names and types, and core copies them, so a
// setting added to the machinery is not silently dropped here.
func TestConfigMatchesCore(t *testing.T) {
	pub, core := reflect.TypeOf(Config{}), reflect.TypeOf(cascadecore.Config{})
	var want []reflect.StructField
	for i := range core.NumField() {
		if f := core.Field(i); f.IsExported() {
			want = append(want, f)
		}
	}
	if pub.NumField() != len(want) {
		t.Fatalf("Config has %d fields, cascadecore.Config %d exported ones", pub.NumField(), len(want))
	}
	for i, w := range want {
		if f := pub.Field(i); f.Name != w.Name || f.Type != w.Type {
			t.Errorf("field %d: %s %v, want %s %v", i, f.Name, f.Type, w.Name, w.Type)
		}
	}
	c := Config{Prefix: "p", Grain: time.Second, Levels: 3, QueueType: "classic", URI: "amqp://x/",
		TopologyCheck: time.Minute, ManagementURL: "http://x", Vhost: "v", FullWait: time.Hour,
		Publisher: &confirm.Publisher{}, Marshaler: amqpretry.Marshaler{MaxHeaderBytes: 7},
		QueueName: func(context.Context) string { return "q" }, Logger: watermill.NopLogger{}}
	got := c.core()
	if got.Prefix != c.Prefix || got.Grain != c.Grain || got.Levels != c.Levels || got.QueueType != c.QueueType || got.URI != c.URI ||
		got.TopologyCheck != c.TopologyCheck || got.ManagementURL != c.ManagementURL || got.Vhost != c.Vhost || got.FullWait != c.FullWait {
		t.Errorf("core() = %+v, from %+v", got, c)
	}
	if got.Publisher != c.Publisher || got.Marshaler.MaxHeaderBytes != 7 || got.QueueName == nil || got.QueueName(context.Background()) != "q" || got.Logger != c.Logger {
		t.Errorf("core() dropped Publisher, Marshaler, QueueName or Logger: %+v", got)
	}
}
