"""Test aids, not imported by the server: `forced` (forced replies through the engine's sampler hook) and `tiny`
(tiny random-weight models for tests, benchmarks and `hyserve make-tiny-model`)."""
