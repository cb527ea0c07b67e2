"""Loading a model: `preflight` (checks before a load), `runtime` (the loaded model, its tokenizer and adapter),
`experts` (which MoE experts implementation runs) and `model_thread` (the one thread that runs every PyTorch
operation). The engine builds on this package; `hyserve.service` wires both together."""
