"""Client requests as the router runs them: validation, tokenization, best_of, per-request metrics."""
