// Command faults-consumer is the consumer process of the fault suite's kill test
// (faults.TestConsumerKilled): a rabbitretry consumer whose handler fails
// transiently for a deterministic share of messages (by a hash of the UUID,
// once or twice) and appends each successfully handled UUID to -out, one
// line per success, fsynced before the handler returns (so before the ack).
//
// With -cascade-prefix its retries go through the delay cascade
// (faults.TestCascadeConsumerKilled).
//
// It prints "READY" on stdout once consuming, and shuts down gracefully on
// SIGTERM or SIGINT. The test kills it with SIGKILL mid-run. It is a test
// helper of the faults package, not a tool for users.
//
// # Imports
//
// A binary: it may import any library package of this module and internal/...;
// nothing imports it (TestLayers in docs/).
package main
