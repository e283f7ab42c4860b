"""kohya (sd-scripts) LoRA files for the tiny Flux and SDXL models, and kohya's own meaning of them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

WHOLE = slice(None)
Q, K, V = slice(0, 32), slice(32, 64), slice(64, 96)


def flux_double(i: int) -> dict[str, tuple[int, int, list[tuple[str, slice]]]]:
    """kohya module -> (in, out, [(diffusers module, rows of lora_up it gets)]) for double block i."""
    block = f"transformer_blocks.{i}"
    return {
        f"lora_unet_double_blocks_{i}_img_attn_qkv": (
            32, 96, [(f"{block}.attn.to_q", Q), (f"{block}.attn.to_k", K), (f"{block}.attn.to_v", V)]),
        f"lora_unet_double_blocks_{i}_img_attn_proj": (32, 32, [(f"{block}.attn.to_out.0", WHOLE)]),
        f"lora_unet_double_blocks_{i}_img_mlp_0": (32, 128, [(f"{block}.ff.net.0.proj", WHOLE)]),
        f"lora_unet_double_blocks_{i}_img_mlp_2": (128, 32, [(f"{block}.ff.net.2", WHOLE)]),
        f"lora_unet_double_blocks_{i}_txt_attn_qkv": (
            32, 96,
            [(f"{block}.attn.add_q_proj", Q), (f"{block}.attn.add_k_proj", K), (f"{block}.attn.add_v_proj", V)]),
        f"lora_unet_double_blocks_{i}_txt_attn_proj": (32, 32, [(f"{block}.attn.to_add_out", WHOLE)]),
        f"lora_unet_double_blocks_{i}_txt_mlp_0": (32, 128, [(f"{block}.ff_context.net.0.proj", WHOLE)]),
        f"lora_unet_double_blocks_{i}_txt_mlp_2": (128, 32, [(f"{block}.ff_context.net.2", WHOLE)]),
    }  # fmt: skip


FLUX_SINGLE = {
    "lora_unet_single_blocks_0_linear2": (160, 32, [("single_transformer_blocks.0.proj_out", WHOLE)]),
    "lora_unet_single_blocks_1_linear2": (160, 32, [("single_transformer_blocks.1.proj_out", WHOLE)]),
}
FLUX_LINEAR1 = {
    "lora_unet_single_blocks_0_linear1": (32, 3 * 32 + 128, [
        ("single_transformer_blocks.0.attn.to_q", Q), ("single_transformer_blocks.0.attn.to_k", K),
        ("single_transformer_blocks.0.attn.to_v", V), ("single_transformer_blocks.0.proj_mlp", slice(96, 224))]),
}  # fmt: skip
FLUX_FINAL = {"lora_unet_final_layer_linear": (32, 16, [("proj_out", WHOLE)])}

# Six SDXL layers of tiny-sdxl (diffusers module, in, out, alpha), which kohya writes in two spellings: the
# diffusers-style names it uses for SD1.x-like UNets, and the sgm (input/middle/output block) names it uses for
# SDXL. Alphas vary per layer, but every attention layer has the most common one (2.0): see the UPSTREAM test.
SDXL_LAYERS = [
    ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", 32, 32, 2.0),
    ("down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_k", 64, 32, 2.0),
    ("down_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj", 32, 256, 8.0),
    ("mid_block.attentions.0.transformer_blocks.1.ff.net.2", 128, 32, 4.0),
    ("up_blocks.0.attentions.2.proj_in", 32, 32, 1.0),
    ("up_blocks.0.attentions.0.transformer_blocks.1.attn1.to_out.0", 32, 32, 2.0),
]
# The sgm block of each attention above. tiny-sdxl: layers_per_block=2, down_blocks.1 and up_blocks.0 carry
# attentions, so input_blocks 4/5 and output_blocks 0..2 are them.
SGM_BLOCKS = {
    "down_blocks.1.attentions.0": "input_blocks.4.1",
    "down_blocks.1.attentions.1": "input_blocks.5.1",
    "mid_block.attentions.0": "middle_block.1",
    "up_blocks.0.attentions.0": "output_blocks.0.1",
    "up_blocks.0.attentions.2": "output_blocks.2.1",
}


def kohya_module(module: str, layout: str) -> str:
    """kohya's name for the SDXL diffusers `module`, in the "diffusers_names" or the "sgm_names" spelling."""
    if layout == "sgm_names":
        attention = next(prefix for prefix in SGM_BLOCKS if module.startswith(prefix + "."))
        module = SGM_BLOCKS[attention] + module[len(attention) :]
    return "lora_unet_" + module.replace(".", "_")


TEXT_ENCODER_MODULES = {
    "lora_te1_text_model_encoder_layers_0_self_attn_q_proj": (32, 32),
    "lora_te2_text_model_encoder_layers_1_self_attn_k_proj": (32, 32),
}
ALPHAS = (1.0, 8.0, None, 2.0)  # cycled over modules; None writes no alpha key (kohya: alpha = rank)


def kohya_file(
    path: Path,
    modules: dict[str, tuple[int, int]],
    rank: int = 4,
    *,
    alphas: dict[str, float | None] | None = None,
    seed: int = 0,
    sparse_qkv: bool = False,
) -> dict[str, torch.Tensor]:
    """Write kohya tensors for `modules` (name -> (in, out)); returns them for the arithmetic oracle.

    Alphas come from `alphas` by module, else cycle through ALPHAS; None writes no alpha key.
    """
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, (module, (in_features, out_features)) in enumerate(modules.items()):
        down = torch.randn(rank, in_features, generator=generator) * 0.2
        up = torch.randn(out_features, rank, generator=generator) * 0.2
        if sparse_qkv and module.endswith("_qkv"):
            # Block-diagonal up: each of q, k, v owns rank/3 columns, which diffusers splits into rank/3 LoRAs.
            mask = torch.block_diag(*[torch.ones(out_features // 3, rank // 3)] * 3)
            up = up * mask
        tensors[f"{module}.lora_down.weight"] = down
        tensors[f"{module}.lora_up.weight"] = up
        alpha = alphas[module] if alphas is not None and module in alphas else ALPHAS[index % len(ALPHAS)]
        if alpha is not None:
            tensors[f"{module}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return tensors


def kohya_deltas(tensors: dict[str, torch.Tensor], mapping: dict[str, list[tuple[str, slice]]]):
    """kohya's meaning of the file: up @ down * alpha / rank, rows of a fused up split per target."""
    deltas = {}
    for module, targets in mapping.items():
        down, up = tensors[f"{module}.lora_down.weight"], tensors[f"{module}.lora_up.weight"]
        rank = down.shape[0]
        alpha = float(tensors.get(f"{module}.alpha", torch.tensor(float(rank))))
        for target, rows in targets:
            deltas[target] = up[rows] @ down * (alpha / rank)
    return deltas


def sdxl_modules(layout: str):
    """(kohya module -> (in, out), kohya module -> alpha, kohya module -> [(diffusers module, rows)])."""
    names = {module: kohya_module(module, layout) for module, *_ in SDXL_LAYERS}
    modules = {names[module]: (in_features, out_features) for module, in_features, out_features, _ in SDXL_LAYERS}
    alphas = {names[module]: alpha for module, _, _, alpha in SDXL_LAYERS}
    mapping = {names[module]: [(module, WHOLE)] for module, *_ in SDXL_LAYERS}
    return modules, alphas, mapping
