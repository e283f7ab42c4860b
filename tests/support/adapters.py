"""Random LoRA adapters written by PEFT for the tiny models, with the scales the image tests rely on."""

from __future__ import annotations

from pathlib import Path

# Factor scales that change the tiny models' images clearly but stay out of the
# chaotic range where float rounding alone flips pixels (tiny-sdxl is touchier).
# name -> (rank, alpha, target modules); ranks 2, 4, 8 and 16 over different layer subsets.
FLUX_ADAPTERS = {
    "r4-attn": (4, 8.0, ("to_q", "to_k", "to_v", "to_out.0")),
    "r8-context": (8, 8.0, ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_out.0")),
    "r16-mlp": (16, 16.0, ("ff.net.0.proj", "ff.net.2", "proj_mlp", "to_v")),
    # Rank 2, for stacks: with r4-attn and r8-context they fill a rank-16 slot exactly on to_out.0,
    # the one layer all four change; elsewhere each has its layers to itself or shares them with one.
    "r2-ff-context": (2, 4.0, ("ff_context.net.0.proj", "ff_context.net.2", "to_out.0")),
    "r2-single": (2, 4.0, ("proj_mlp", "proj_out", "to_out.0", "to_q")),
}
SDXL_ADAPTERS = {
    "r4-attn": (4, 8.0, ("to_q", "to_k", "to_v", "to_out.0")),
    "r16-ff": (16, 8.0, ("ff.net.0.proj", "ff.net.2", "to_q")),
}


def write_adapters(model: str, directory: Path, specs: dict, init_std: float) -> Path:
    """Write each spec (name -> (rank, alpha, targets)) as a PEFT-written adapter folder under directory."""
    adapters = {
        name: dict(rank=rank, alpha=alpha, target_modules=targets, seed=index + 1)
        for index, (name, (rank, alpha, targets)) in enumerate(specs.items())
    }
    return write_random_adapters(model, directory, adapters, init_std)


def write_random_adapters(model: str, directory: Path, adapters: dict[str, dict], init_std: float) -> Path:
    """Write each adapter (name -> write_random_adapter's keywords: rank, alpha, target_modules, seed, use_dora,
    lora_bias, ...) as a PEFT-written adapter folder under directory, all for one build of `model`."""
    from loraswap.server.devtools.random_adapter import write_random_adapter
    from loraswap.server.engine.models import builtin_model

    pipe = builtin_model(model).build()
    for name, keywords in adapters.items():
        write_random_adapter(pipe, directory / name, init_std=init_std, **keywords)
    return directory
