"""loraswap: one warm diffusion pipeline, many LoRA adapters swapped in place."""
