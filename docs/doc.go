// Package docs holds the documentation pages of rabbitretry (Markdown); it
// has no code. Its tests keep the pages honest: every Go snippet that is a
// complete program (package main) is compiled, every reference to an
// identifier of this module's packages (amqpretry.Config, middleware.RetryAfter,
// ...) in any snippet must exist, every relative link must point to a file
// that exists, and the README's layout table must list exactly the packages
// of `go list ./...`.
package docs
