"""The schemes `--quantization` takes and the format choices shared by `apply` and the loader (`loading`)."""

SCHEMES = ("int8", "int4")
HEAD = "int8"  # the output head's (and a tied embedding's) format under every scheme
ROUTERS = ("gate", "shared_expert_gate", "router")  # MoE routers' names: kept in float, as llama.cpp keeps them
