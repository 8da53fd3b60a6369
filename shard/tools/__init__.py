"""Tools around the product: model download, GGUF conversion, tiny test models."""
