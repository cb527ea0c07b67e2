"""Loading a model and wiring it into an engine: `preflight` (checks before a load), `runtime` (the loaded model,
its tokenizer and adapter), `experts` (which MoE experts implementation runs), `model_thread` (the one thread
that runs every PyTorch operation) and `service` (a model directory wired into a running engine with its prefix
cache, policy, metrics and parsers). Kept empty of imports: the engine imports `runtime` and `model_thread` while
`service` imports the engine."""
