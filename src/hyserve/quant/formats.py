"""The schemes `--quantization` takes and the format choices shared by `apply` and the loader (`loading`).

int8 / int4 are weight-only: the products' inputs stay in the model's dtype. w8a8 / w4a8 hold the same weights
and round each product's input to Q8_0 blocks, multiplying in integers, as llama.cpp computes its Q8_0 and Q4_0
files: faster where widening the weights to float bounds a product (4 bits), at the cost of that rounding."""

SCHEMES = ("int8", "int4", "w8a8", "w4a8")
WEIGHTS = {"int8": "int8", "int4": "int4", "w8a8": "int8", "w4a8": "int4"}  # each scheme's format of the weights
INT8_ACTIVATIONS = ("w8a8", "w4a8")
WEIGHT_ONLY = ("int8", "int4")
# The output head's (and a tied embedding's) format per scheme: its errors land on every logit, so it is never
# below 6 bits (llama.cpp's Q8_0 files hold it at Q8_0, its Q4_0 and Q4_K_M files at Q6_K). w4a8's is 6-bit
# (`layout`'s Q6_0); int4's stays Q8_0 until the weight-only products (`products.c`) take 6-bit weights.
HEADS = {"int8": "int8", "int4": "int8", "w8a8": "int8", "w4a8": "int6"}
FORMATS = {"int8": "q8_0", "int4": "q4_0", "int6": "q6_0"}  # each weight format's blocks (`layout.format_of`)
ROUTERS = ("gate", "shared_expert_gate", "router")  # MoE routers' names: kept in float, as llama.cpp keeps them
