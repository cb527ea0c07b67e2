"""One module per GGUF architecture family hyserve loads itself; the interface is in `..architectures`."""
