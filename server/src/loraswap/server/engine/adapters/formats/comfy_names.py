"""ComfyUI's, ai-toolkit's and PEFT's names of a denoiser's own layers, read as the kohya-style names they spell.

ComfyUI and ai-toolkit write a denoiser's layers as `diffusion_model.<module path>.<tensor>`, a PEFT-wrapped model's
state dict as `base_model.model.<module path>.<tensor>`, with PEFT's factor names (`lora_A`, `lora_B`) or kohya's
(`lora_down`, `lora_up`, `alpha`, the LyCORIS kinds' tensors); the module path is the model's own, in diffusers'
names or the original model's (BFL FLUX.2's fused qkv, Z-Image's `attention.qkv`). Written `<prefix>_<path with
'_' for '.'>` with the family's kohya prefix of its denoiser (`lora_unet`) and kohya's factor names, such a file is
a kohya-style one: for the newer families (FamilyTraits.reads_module_path_files) it is read by kohya_layout.py,
which resolves each name against the model's module paths and original names (original_names.py), cuts fused
layers at the model's own widths and reads every kind and each layer's alpha.

diffusers' converters for these families read only some of these files, and misread others without a word: FLUX.2's
`diffusion_model.` names with `lora_down`/`lora_up` convert to nothing, with `alpha` tensors they raise, its final
modulation keeps BFL's (shift, scale) order; Z-Image's fused `qkv` and `out` in `lora_A`/`lora_B` files come out
as layers the model does not have. FLUX.1 and SDXL files in these prefixes go to diffusers' converters, as before.
"""

from __future__ import annotations

import torch

from loraswap.server.engine.adapters.formats.key_layouts import LAYER_NAME, LAYER_TENSORS, UNSUPPORTED_KIND_TENSORS
from loraswap.server.engine.adapters.formats.tensor_names import PEFT_TO_KOHYA, with_adapter_name
from loraswap.server.engine.errors import AdapterFormatError, shorten
from loraswap.server.engine.families import FAMILIES
from loraswap.server.engine.types import ModelFamily

# What starts the denoiser's module paths: ComfyUI's and ai-toolkit's prefix, a PEFT-wrapped model's.
MODEL_PREFIXES = ("diffusion_model.", "base_model.model.")
# A tensor's name in these files -> its kohya name: PEFT's factors (with or without PEFT's adapter name), and the
# names kohya and LyCORIS already use (IA³'s bare `weight` left out: it is also how a base weight is named).
_TENSOR_NAMES = {
    **PEFT_TO_KOHYA,
    **{with_adapter_name(peft): kohya for peft, kohya in PEFT_TO_KOHYA.items()},
    **{name: name for name in LAYER_TENSORS | UNSUPPORTED_KIND_TENSORS.keys() if name != "weight"},
}
_BY_LENGTH = sorted(_TENSOR_NAMES, key=len, reverse=True)  # the longest name a key ends in is its tensor's


def _split(path_and_tensor: str) -> tuple[str, str] | None:
    """(module path, kohya tensor name) of `<module path>.<tensor>`; None when the tensor's name is none known."""
    for name in _BY_LENGTH:
        if path_and_tensor.endswith("." + name):
            return path_and_tensor[: -len(name) - 1], _TENSOR_NAMES[name]
    return None


def _denoiser_prefix(family: ModelFamily) -> str | None:
    """The kohya prefix renamed layers get: the first of the family's kohya_prefixes that names its denoiser; None
    for a family that does not read module-path files (or has no such prefix)."""
    traits = FAMILIES[family]
    if not traits.reads_module_path_files:
        return None
    denoiser = traits.denoiser_attribute
    return next((prefix for prefix, component in traits.kohya_prefixes.items() if component == denoiser), None)


def comfy_as_kohya(
    state_dict: dict[str, torch.Tensor], family: ModelFamily
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file with its model-prefixed keys renamed to kohya-style ones, and each renamed layer's name as the file
    spells it (kohya layer -> file layer), for messages.

    The file itself (no renamed layers) for a family that does not read module-path files, and for a file with a
    model-prefixed key of a tensor no kind has or a module path kohya cannot spell: such a file goes to diffusers'
    converters whole.
    Raises ADAPTER_MALFORMED when a layer is in the file twice, under two layouts or spellings.
    """
    kohya_prefix = _denoiser_prefix(family)
    prefixed = [key for key in state_dict if key.startswith(MODEL_PREFIXES)] if kohya_prefix else []
    if not prefixed:
        return state_dict, {}
    renamed: dict[str, tuple[str, str]] = {}  # file key -> (kohya key, file layer)
    for key in prefixed:
        prefix = next(prefix for prefix in MODEL_PREFIXES if key.startswith(prefix))
        split = _split(key[len(prefix) :])
        if split is None or not LAYER_NAME.fullmatch(flat := split[0].replace(".", "_")):
            return state_dict, {}
        renamed[key] = (f"{kohya_prefix}_{flat}.{split[1]}", prefix + split[0])
    result = {key: value for key, value in state_dict.items() if key not in renamed}
    # kohya layer -> how the file spells it: one layer's tensors under two spellings (`diffusion_model.x.lora_A`
    # beside `lora_unet_x.lora_up`) would be read as one layer made of both.
    spelled = {key.partition(".")[0]: key.partition(".")[0] for key in result}
    for key, (kohya_key, layer) in renamed.items():
        kohya_layer = kohya_key.partition(".")[0]
        if kohya_key in result:
            raise AdapterFormatError(
                f"layer {shorten(kohya_layer)} is in the file twice, under two naming layouts "
                f"(one is {shorten(key)}); keep one",
            )
        if (other := spelled.setdefault(kohya_layer, layer)) != layer:
            raise AdapterFormatError(
                f"layer {shorten(kohya_layer)} is in the file twice, under two naming layouts "
                f"(as {shorten(other)} and {shorten(layer)}); keep one",
            )
        result[kohya_key] = state_dict[key]
    return result, {kohya_key.partition(".")[0]: layer for kohya_key, layer in renamed.values()}
