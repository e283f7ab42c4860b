"""Random LoRA adapters in diffusers format, written by PEFT, for smoke tests, demos and benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch

from loraswap.server.engine.families import family_of

DEFAULT_RANDOM_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
_TRAINING_ADAPTER = "loraswap_random"


def write_random_adapter(
    pipe,
    directory: str | Path,
    *,
    rank: int,
    alpha: float | None = None,
    target_modules: tuple[str, ...] = DEFAULT_RANDOM_TARGETS,
    seed: int = 0,
    init_std: float | None = None,
    use_dora: bool = False,
    lora_bias: bool = False,
) -> Path:
    """Add a random PEFT LoRA to the pipeline's denoiser, save it with diffusers, remove it again.

    `init_std` draws both factors from N(0, init_std); the default keeps PEFT's
    own random init (`init_lora_weights=False`). `use_dora` makes a DoRA adapter (PEFT's magnitude vectors
    beside the factors), `lora_bias` one that trains lora_B's bias. Returns the written file.
    """
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    traits = family_of(pipe)
    denoiser = traits.denoiser(pipe)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        target_modules=list(target_modules),
        init_lora_weights=False,
        use_dora=use_dora,
        lora_bias=lora_bias,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        denoiser.add_adapter(config, adapter_name=_TRAINING_ADAPTER)
        state_dict = get_peft_model_state_dict(denoiser, adapter_name=_TRAINING_ADAPTER)
        if init_std is not None:
            # A DoRA magnitude keeps PEFT's own start (the base weight's row norms): random ones would be nonsense.
            state_dict = {
                key: value if "lora_magnitude_vector" in key else torch.randn_like(value) * init_std
                for key, value in state_dict.items()
            }
    state_dict = {key: value.detach().clone().contiguous() for key, value in state_dict.items()}
    denoiser.delete_adapters(_TRAINING_ADAPTER)
    directory = Path(directory)
    traits.save_lora_weights(directory, state_dict, config.to_dict())
    return directory / "pytorch_lora_weights.safetensors"
