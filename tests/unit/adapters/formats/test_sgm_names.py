"""The sgm (original SDXL UNet) layer names sd-scripts writes, mapped to full-size SDXL's diffusers module paths.

The sgm names are generated here from the original UNet's own structure (sgm's openaimodel UNetModel at SDXL's
settings: conv_in, per level num_res_blocks x [ResBlock, SpatialTransformer?] then a Downsample, the middle block,
per level reversed num_res_blocks + 1 x [ResBlock, SpatialTransformer?] then an Upsample, the embeddings and `out`).
Each name's diffusers path comes from diffusers' own single-file converter (`convert_ldm_unet_checkpoint`, what
`from_single_file` loads original SDXL checkpoints with), an oracle independent of adapters/formats/key_layouts.py; the
paths are checked to be real layers of a meta-device full-size SDXL UNet, and every one of its mergeable layers
outside the attention blocks' inner modules to be reached.
"""

from __future__ import annotations

import pytest
import torch

from loraswap.server.engine.adapters.formats import ModelLayers, sgm_to_diffusers
from loraswap.server.engine.models.random_full import SDXL_UNET_CONFIG

LEVELS = 3  # channel_mult (1, 2, 4)
RES_BLOCKS = 2
ATTENTION_DEPTH = (0, 2, 10)  # transformer_depth per level; 0: no attention
MIDDLE_DEPTH = 10
RESNET = ("in_layers.2", "emb_layers.1", "out_layers.3")
TRANSFORMER_BLOCK = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                     "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")  # fmt: skip


def _resnet(prefix: str, skip: bool) -> list[str]:
    return [f"{prefix}.{name}" for name in RESNET] + ([f"{prefix}.skip_connection"] if skip else [])


def _transformer(prefix: str, depth: int) -> list[str]:
    inner = [f"{prefix}.transformer_blocks.{k}.{name}" for k in range(depth) for name in TRANSFORMER_BLOCK]
    return [f"{prefix}.proj_in", f"{prefix}.proj_out", *inner]


def sgm_layers() -> list[str]:
    """Every linear and conv layer of the original SDXL UNet, by its sgm module path."""
    layers = ["input_blocks.0.0", "time_embed.0", "time_embed.2", "label_emb.0.0", "label_emb.0.2", "out.2"]
    index = 1
    for level in range(LEVELS):
        for block in range(RES_BLOCKS):
            layers += _resnet(f"input_blocks.{index}.0", skip=level > 0 and block == 0)
            if ATTENTION_DEPTH[level]:
                layers += _transformer(f"input_blocks.{index}.1", ATTENTION_DEPTH[level])
            index += 1
        if level < LEVELS - 1:
            layers.append(f"input_blocks.{index}.0.op")
            index += 1
    layers += _resnet("middle_block.0", False) + _transformer("middle_block.1", MIDDLE_DEPTH)
    layers += _resnet("middle_block.2", False)
    index = 0
    for level in reversed(range(LEVELS)):
        for block in range(RES_BLOCKS + 1):
            layers += _resnet(f"output_blocks.{index}.0", skip=True)  # every output resnet takes a concatenation
            sub = 1
            if ATTENTION_DEPTH[level]:
                layers += _transformer(f"output_blocks.{index}.1", ATTENTION_DEPTH[level])
                sub = 2
            if level > 0 and block == RES_BLOCKS:
                layers.append(f"output_blocks.{index}.{sub}.conv")
            index += 1
    return layers


@pytest.fixture(scope="module")
def diffusers_paths() -> dict[str, str]:
    """sgm path -> diffusers path, as diffusers' single-file converter maps an original checkpoint."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    tensors = {layer: torch.empty(1, device="meta") for layer in sgm_layers()}
    checkpoint = {f"model.diffusion_model.{layer}.weight": tensor for layer, tensor in tensors.items()}
    checkpoint |= {f"model.diffusion_model.{layer}.bias": torch.empty(1, device="meta") for layer in tensors}
    converted = convert_ldm_unet_checkpoint(checkpoint, dict(SDXL_UNET_CONFIG))
    by_tensor = {id(tensor): key.removesuffix(".weight") for key, tensor in converted.items()}
    return {layer: by_tensor[id(tensor)] for layer, tensor in tensors.items()}


@pytest.fixture(scope="module")
def full_sdxl() -> ModelLayers:
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SDXL_UNET_CONFIG)
    return ModelLayers.of({"unet": unet})


def test_the_oracle_reaches_every_layer_of_full_size_sdxl(diffusers_paths, full_sdxl) -> None:
    """The generated names are the original UNet's: one per layer of the full-size diffusers UNet, each a real one."""
    assert len(set(diffusers_paths.values())) == len(diffusers_paths)
    assert set(diffusers_paths.values()) == set(full_sdxl.shapes["unet"])


def test_every_sgm_name_maps_to_the_layer_diffusers_loads_it_into(diffusers_paths, full_sdxl) -> None:
    wrong = {}
    for sgm, expected in diffusers_paths.items():
        flat = sgm_to_diffusers(sgm.replace(".", "_"), SDXL_UNET_CONFIG)
        resolved = full_sdxl.by_flat_name("unet", flat) if flat is not None else None
        if resolved != expected:
            wrong[sgm] = (resolved, expected)
    assert wrong == {}
