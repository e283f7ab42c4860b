"""The diffusers-named keys of the newer families' files, made the keys diffusers' converters and loader read.

diffusers reads a family's LoRA as `<component>.<module path>.lora_A.weight` (and `lora_B`), with the alphas a
converter returns beside it. Qwen-Image, Z-Image and FLUX.2 files in diffusers' module names often differ from that
in ways their converters miss, so they are normalised first (`normalised_keys`, diffusers_layout.py calls it once):
- PEFT's adapter name in the factors' names (`….lora_A.default.weight`, from a PEFT model's state dict): the
  Qwen-Image and Z-Image converters remove it but prefix keys already prefixed (`transformer.transformer.…`), and
  FLUX.2's keeps it; it is removed here.
- no component prefix (`transformer_blocks.0.attn.to_q.lora_A.weight`, what PEFT's get_peft_model_state_dict
  gives): diffusers' loader drops such keys unseen; a key whose first name is a child of the denoiser gets the
  denoiser's prefix.
- kohya's names beside diffusers' module paths: `alpha` tensors (`transformer.….alpha`), which the Qwen-Image and
  Z-Image converters double the prefix of and FLUX.2's leaves as tensors no LoRA has, become the file's alphas,
  one for every layer as kohya's names mean them (a layer without one, or with 0, has alpha = rank), which PEFT's
  config then gets per layer; `lora_down`/`lora_up` factors (which FLUX.2's kohya converter drops) are
  `lora_A`/`lora_B`.
A converter that makes nothing of a non-empty file (FLUX.2's kohya converter, given names it does not know) is
refused, saying which layouts are read (`refuse_nothing_converted`): never an adapter that changes nothing.
FLUX.1's and SDXL's files reach their converters untouched.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loraswap.server.engine.adapters.formats.tensor_checks import alpha_value
from loraswap.server.engine.adapters.formats.tensor_names import KOHYA_TO_PEFT, PEFT_TENSORS, without_adapter_name
from loraswap.server.engine.errors import AdapterFormatError, ErrorReason, shorten
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.types import ModelFamily

# kohya's factor names beside diffusers' module paths, as PEFT's.
_KOHYA_FACTORS = {f".{kohya}": f".{peft}" for kohya, peft in KOHYA_TO_PEFT.items()}
# Every tensor name these normalisations know; a file with any other (Z-Image's `.lora.down.weight`, LyCORIS kinds)
# is left to the family's converter whole, as it always was.
_KNOWN_TENSORS = (*(f".{name}" for name in PEFT_TENSORS), ".alpha", *_KOHYA_FACTORS)


def normalised_keys(
    state_dict: dict[str, torch.Tensor], family: ModelFamily, denoiser: str, denoiser_modules: Mapping[str, object]
) -> tuple[dict[str, torch.Tensor], dict[str, float] | None]:
    """(the state dict in the keys diffusers reads, the alphas taken out of it or None), for a family that reads
    module-path files; any other family's state dict itself (the very dict its converter always got), and None;
    so too a file with a tensor name the normalisations do not know.

    `denoiser_modules`: the denoiser's module paths (its children are what an unprefixed key may start with).
    Raises ADAPTER_MALFORMED when two keys name the same tensor, ADAPTER_SHAPE_MISMATCH for an alpha of more than one
    value.
    """
    if not FAMILIES[family].reads_module_path_files:
        return state_dict, None
    names = {key: without_adapter_name(key) for key in state_dict}
    if not all(name.endswith(_KNOWN_TENSORS) for name in names.values()):
        return state_dict, None
    children = {module.partition(".")[0] for module in denoiser_modules}
    keys: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for key, value in state_dict.items():
        name = names[key]
        if name.partition(".")[0] in children:
            name = f"{denoiser}.{name}"
        if name.startswith(denoiser + ".") and name.endswith(tuple(_KOHYA_FACTORS)):
            kohya = next(suffix for suffix in _KOHYA_FACTORS if name.endswith(suffix))
            name = name.removesuffix(kohya) + _KOHYA_FACTORS[kohya]
        if name in keys or name in alphas:
            raise AdapterFormatError(f"tensor {shorten(name)} is in the file twice, under two spellings; keep one")
        if name.startswith(denoiser + ".") and name.endswith(".alpha"):
            alphas[name] = alpha_value(key.removesuffix(".alpha"), value)
        else:
            keys[name] = value
    return keys, _every_layers_alpha(keys, alphas) if alphas else None


def _every_layers_alpha(keys: Mapping[str, torch.Tensor], alphas: dict[str, float]) -> dict[str, float]:
    """The file's alphas with one for every layer, as kohya's names mean them (key_layouts.py): a layer's alpha is
    its own, and a layer without one, or with 0, has alpha = rank (scale 1). Left to PEFT's config, a layer without
    one would take the file's most common alpha, and an alpha of 0 would switch its layer off: one file would mean
    something else in diffusers' names than in kohya's or ComfyUI's."""
    complete = {}
    for key, down in keys.items():
        if key.endswith(".lora_A.weight") and down.ndim >= 1:
            alpha = f"{key.removesuffix('.lora_A.weight')}.alpha"
            complete[alpha] = alphas.get(alpha) or float(down.shape[0])
    return complete | {key: value for key, value in alphas.items() if key not in complete}


def refuse_nothing_converted(
    state_dict: Mapping[str, torch.Tensor], converted: Mapping[str, torch.Tensor], family: ModelFamily
) -> None:
    """Refuse, saying which layouts are read, a file of a family that reads module-path files
    (FamilyTraits.reads_module_path_files) of which diffusers' converter made nothing (`state_dict`: what it was
    given, `converted`: what it returned)."""
    if not FAMILIES[family].reads_module_path_files or converted or not state_dict:
        return
    raise AdapterFormatError(
        f"diffusers' {family.value} converter read none of the adapter's {len(state_dict)} tensors "
        f"(e.g. {shorten(min(state_dict), 120)}); {family.value} adapters are read in diffusers' names "
        "(`transformer.<module path>.lora_A.weight`), kohya's (`lora_unet_<module path, '_' for '.'>.lora_down.weight` "
        "and `.alpha`, diffusers' module paths or the original model's) and ComfyUI's or ai-toolkit's "
        "(`diffusion_model.<module path>.lora_A.weight` or `.lora_down.weight`): rename the keys to one of these",
        reason=ErrorReason.ADAPTER_MALFORMED,
    )
