"""The files of a model folder that matter to hyserve: its weights and its tokenizer. The start-up checks
(`models.preflight`) look for them and the disk cache's fingerprint (`cache.fingerprint`) hashes them, so both
read the one list here."""

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
