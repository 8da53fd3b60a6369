"""Output parsers: reasoning split and each model family's tool-call format (see contracts.py)."""
