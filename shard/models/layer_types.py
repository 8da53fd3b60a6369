"""Which decoder layers attend locally (sliding window) and which globally, from a config.

transformers (5.x) writes `layer_types` into configs ("sliding_attention" / "full_attention" per
layer); older checkpoints give a pattern instead: Gemma 2 alternates (layer 0 local), Gemma 3 has
`sliding_window_pattern` N (every N-th layer global, the others local)."""

from __future__ import annotations

SLIDING = "sliding_attention"
FULL = "full_attention"

# model_type -> its fixed pattern where the config has neither layer_types nor a pattern field
_DEFAULT_PATTERNS = {"gemma2": 2, "gemma3_text": 6}


def layer_types(config: dict) -> list[str]:
    """Per layer SLIDING or FULL; ValueError naming the field when layer_types is malformed."""
    n = config["num_hidden_layers"]
    given = config.get("layer_types")
    if given:
        if len(given) != n or any(t not in (SLIDING, FULL) for t in given):
            raise ValueError(f"config layer_types must list {n} entries of {SLIDING!r} or "
                             f"{FULL!r}; got {given!r}")
        return list(given)
    pattern = (config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
               or _DEFAULT_PATTERNS.get(config.get("model_type", "")))
    if not pattern:
        return [FULL] * n
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def layer_windows(config: dict) -> list[int | None]:
    """Per layer the sliding window (config sliding_window) of local layers, None for global."""
    window = config.get("sliding_window")
    return [window if t == SLIDING else None for t in layer_types(config)]
