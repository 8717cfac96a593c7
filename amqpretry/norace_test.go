//go:build !race

package amqpretry_test

const raceEnabled = false
