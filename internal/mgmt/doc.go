// Package mgmt is the project's one client of the RabbitMQ management HTTP
// API ("Management Plugin", "HTTP API" page): parsing and validating a
// management URL, sending a JSON request with the URL's user info as
// basic auth, and telling a 404 (NotFoundError) from other failures.
//
// It is internal: only the library's own packages (amqpretry,
// amqpretry/cascade, audit) and its commands import it; users configure a
// management URL through those packages' Config fields. Nothing here
// shows a password: URL errors are redacted with internal/redact, and
// request errors name the method and path only.
package mgmt
