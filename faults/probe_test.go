package faults

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestProbe(t *testing.T) {
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName("probe-conn")
	c, err := amqp.DialConfig(brokerURI(t), amqp.Config{Properties: props})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	t.Log(c.LocalAddr())
	out, err := rabbitmqctl(t, 30e9, "-q", "list_connections", "pid", "peer_port", "client_properties", "--formatter", "json")
	t.Log(out, err)
	t.Logf("%+v", listConnections(t))
}
