"""Z-Image's original layer names (ComfyUI's: fused `attention.qkv`, `attention.out`, `x_embedder`, `final_layer`),
mapped to the diffusers layers of full-size Z-Image built on the meta device.

The original names are generated here from the original model's structure at Z-Image's config (30 layers and two
noise and two context refiners, each with qkv, out and the w1/w2/w3 feed-forward; adaLN modulation in the layers and
noise refiners; the embedders and the final layer). diffusers' single-file converter
(`convert_z_image_transformer_checkpoint_to_diffusers`) is the oracle (original_rows.py).
"""

from __future__ import annotations

from tests.unit.adapters.formats.family_models import FULL, model
from tests.unit.adapters.formats.original_rows import assert_original_names_reach_the_converters_rows, converted_rows

ADALN = 256  # the modulation's input width: min(dim, 256)


def z_image_linears(config: dict) -> dict[str, tuple[int, int]]:
    """Every linear layer of the original Z-Image at this config by its module path: (out, in)."""
    dim, hidden = config["dim"], int(config["dim"] / 3 * 8)
    patch = config["all_patch_size"][0] ** 2 * config["all_f_patch_size"][0] * config["in_channels"]
    layers = {"x_embedder": (dim, patch), "t_embedder.mlp.0": (1024, 256), "t_embedder.mlp.2": (min(dim, ADALN), 1024),
              "cap_embedder.1": (dim, config["cap_feat_dim"]), "final_layer.linear": (patch, dim),
              "final_layer.adaLN_modulation.1": (dim, min(dim, ADALN))}  # fmt: skip
    blocks = [(f"layers.{i}", True) for i in range(config["n_layers"])]
    blocks += [(f"{refiner}.{i}", refiner == "noise_refiner") for refiner in ("noise_refiner", "context_refiner")
               for i in range(config["n_refiner_layers"])]  # fmt: skip
    for block, modulated in blocks:
        layers |= {f"{block}.attention.qkv": (3 * dim, dim), f"{block}.attention.out": (dim, dim),
                   f"{block}.feed_forward.w1": (hidden, dim), f"{block}.feed_forward.w2": (dim, hidden),
                   f"{block}.feed_forward.w3": (hidden, dim)}  # fmt: skip
        if modulated:
            layers[f"{block}.adaLN_modulation.0"] = (4 * dim, min(dim, ADALN))
    return layers


def test_every_original_z_image_layer_maps_to_the_rows_diffusers_single_file_converter_gives() -> None:
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    family, transformer, layers = model("z-image")
    linears = z_image_linears(FULL["z-image"][1])
    converted, spans = converted_rows(linears, convert_z_image_transformer_checkpoint_to_diffusers, {})
    assert_original_names_reach_the_converters_rows(family, layers, transformer.config, linears, converted, spans)
