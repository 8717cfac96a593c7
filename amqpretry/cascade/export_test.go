package cascade

import "github.com/rabbitretry/rabbitretry/internal/cascadecore"

// Core exposes Config.core to the external tests (deleting the test
// cascade).
func Core(c Config) cascadecore.Config { return c.core() }
