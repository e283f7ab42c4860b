"""Scripts that train the `shapes` model and its demo adapters from scratch (never run in CI)."""
