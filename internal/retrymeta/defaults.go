package retrymeta

// Defaults of the retry policy (router.Policy.WithDefaults, and the
// middlewares' own Configs), documented on the fields that use them.

// DefaultMaxAttempts is the default of middleware.RepublisherConfig.MaxAttempts (and
// router.Policy.MaxAttempts): the first attempt and four retries.
const DefaultMaxAttempts = 5

// DefaultMaxRedeliveries is the default of middleware.RedeliveryGuardConfig.MaxRedeliveries.
const DefaultMaxRedeliveries = 3
