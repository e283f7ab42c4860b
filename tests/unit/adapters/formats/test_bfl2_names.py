"""FLUX.2's BFL layer names (sd-scripts', musubi-tuner's, ai-toolkit's and ComfyUI's), mapped to the diffusers layers
of full-size FLUX.2 [dev], [klein] 4B and [klein] 9B built on the meta device.

The BFL names are generated here from BFL's FLUX.2 structure at each model's config: img_in, txt_in, time_in,
guidance_in ([dev] only), the three shared modulations, the double blocks (img/txt attention qkv and proj, SwiGLU
MLPs 0 and 2), the single blocks (linear1, linear2) and final_layer. diffusers' single-file converter
(`convert_flux2_transformer_checkpoint_to_diffusers`) is the oracle (original_rows.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.adapters.formats.family_models import FULL, model
from tests.unit.adapters.formats.original_rows import assert_original_names_reach_the_converters_rows, converted_rows

FLUX2_MODELS = ["flux2-dev", "flux2-klein-4b", "flux2-klein-9b"]


def bfl2_linears(config: dict) -> dict[str, tuple[int, int]]:
    """Every linear layer of BFL's FLUX.2 at this config by its module path: (out, in)."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(hidden * config["mlp_ratio"])
    channels, time = config["in_channels"] * config["patch_size"] ** 2, config["timestep_guidance_channels"]
    layers = {"img_in": (hidden, channels), "txt_in": (hidden, config["joint_attention_dim"]),
              "time_in.in_layer": (hidden, time), "time_in.out_layer": (hidden, hidden),
              "double_stream_modulation_img.lin": (6 * hidden, hidden),
              "double_stream_modulation_txt.lin": (6 * hidden, hidden),
              "single_stream_modulation.lin": (3 * hidden, hidden)}  # fmt: skip
    if config["guidance_embeds"]:
        layers |= {"guidance_in.in_layer": (hidden, time), "guidance_in.out_layer": (hidden, hidden)}
    for i in range(config["num_layers"]):
        for stream in ("img", "txt"):
            block = f"double_blocks.{i}.{stream}"
            layers |= {f"{block}_attn.qkv": (3 * hidden, hidden), f"{block}_attn.proj": (hidden, hidden),
                       f"{block}_mlp.0": (2 * mlp, hidden), f"{block}_mlp.2": (hidden, mlp)}  # fmt: skip
    for i in range(config["num_single_layers"]):
        layers |= {f"single_blocks.{i}.linear1": (3 * hidden + 2 * mlp, hidden),
                   f"single_blocks.{i}.linear2": (hidden, hidden + mlp)}  # fmt: skip
    return layers | {"final_layer.linear": (channels, hidden), "final_layer.adaLN_modulation.1": (2 * hidden, hidden)}


def bfl2_norm_scales(config: dict) -> dict[str, torch.Tensor]:
    """The QK-norm scales of every block: no layers a merge reaches, but part of a BFL checkpoint."""
    head = config["attention_head_dim"]
    names = [f"double_blocks.{i}.{s}_attn.norm.{n}_norm.scale" for i in range(config["num_layers"])
             for s in ("img", "txt") for n in ("query", "key")]  # fmt: skip
    names += [
        f"single_blocks.{i}.norm.{n}_norm.scale" for i in range(config["num_single_layers"]) for n in ("query", "key")
    ]
    return {name: torch.ones(head) for name in names}


@pytest.mark.parametrize("name", FLUX2_MODELS)
def test_every_bfl2_layer_maps_to_the_rows_diffusers_single_file_converter_gives(name: str) -> None:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    family, transformer, layers = model(name)
    config = FULL[name][1]
    linears = bfl2_linears(config)
    converted, spans = converted_rows(
        linears, convert_flux2_transformer_checkpoint_to_diffusers, bfl2_norm_scales(config)
    )
    assert_original_names_reach_the_converters_rows(family, layers, transformer.config, linears, converted, spans)
