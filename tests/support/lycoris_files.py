"""LyCORIS adapter files written by the LyCORIS package's own kohya network (lycoris-lora), on the tiny SDXL model,
and that network's forward as the reference the server's merges must equal.

The network is the one sd-scripts trains with (`lycoris.kohya`): layer names `lora_unet_<diffusers module path>`,
`lora_te1_…`, `lora_te2_…`. Its factors start at zero change, so every trainable tensor is drawn at random (DoRA
magnitudes scaled around their trained start) before the file is saved.

The reference is each LyCORIS module's own forward (the network applied to a fresh pipeline): never the package's
`merge_to` / `get_merged_weight`, which scale LoHa and LoKr by alpha / rank twice in 4.1.3.
"""

from __future__ import annotations

from pathlib import Path

import torch

# What the test network covers: every module kind a merge reaches in the UNet (attention projections, the resnets'
# 3x3 and 1x1 convs and time_emb_proj, the samplers, conv_in/conv_out, the time and conditioning embeddings) and
# both CLIP text encoders' attention and MLP layers. (LyCORIS's own "full" preset names time_embedding twice on a
# diffusers UNet, which its network refuses.)
TEST_PRESET = {
    "enable_conv": True,
    "unet_target_module": ["Transformer2DModel", "ResnetBlock2D", "Downsample2D", "Upsample2D"],
    "unet_target_name": [
        "conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2",
        "add_embedding.linear_1", "add_embedding.linear_2",
    ],
    "text_encoder_target_module": ["CLIPAttention", "CLIPMLP"],
    "text_encoder_target_name": [],
}  # fmt: skip
PRESET_NAME = "loraswap-tests"

# name -> create_network keywords: one file per kind and variant the server merges.
KINDS = {
    "loha": dict(algo="loha"),
    "loha-tucker": dict(algo="loha", use_tucker=True),
    "lokr": dict(algo="lokr", factor=4),
    "lokr-whole": dict(algo="lokr", factor=4, full_matrix=True),  # both factors whole: alpha must not scale them
    "locon": dict(algo="locon"),
    "locon-tucker": dict(algo="locon", use_tucker=True),
    "full": dict(algo="full"),
    "dora": dict(algo="lora", dora_wd=True),
    "loha-dora": dict(algo="loha", dora_wd=True),
}
# Kinds the server refuses, as LyCORIS writes them.
UNSUPPORTED_KINDS = {"diag-oft": dict(algo="diag-oft"), "ia3": dict(algo="ia3")}  # (BOFT cannot factor the tiny widths)


async def assert_ia3_refused_and_serving_on(image) -> None:
    """The file `ia3` (an IA³ file, written from UNSUPPORTED_KINDS) is refused naming its kind, and the base image
    comes back unchanged; `image(members)` generates with the stack `members` and returns the result."""
    import grpc
    import pytest

    from loraswap.client import LoraswapError

    base = (await image([])).data
    with pytest.raises(LoraswapError) as caught:
        await image([("ia3", 1.0)])
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "ADAPTER_KIND_UNSUPPORTED")
    assert "IA³" in caught.value.message
    assert (await image([])).data == base


def _use_preset(preset: dict) -> None:
    from lycoris.config import PRESET
    from lycoris.kohya import LycorisNetworkKohya

    PRESET[PRESET_NAME] = preset
    LycorisNetworkKohya.apply_preset(preset)


def _text_encoders(pipe) -> list[torch.nn.Module]:
    return [pipe.text_encoder, pipe.text_encoder_2]


def write_lycoris_file(
    path: Path, kind: dict, *, seed: int, std: float = 0.3, rank: int = 4, alpha: float = 2.0,
    text_encoders: bool = True, preset: dict = TEST_PRESET,
) -> Path:  # fmt: skip
    """Write one LyCORIS file of `kind` (create_network keywords) for a fresh tiny-sdxl build; returns its path."""
    from lycoris.kohya import create_network

    from loraswap.server.engine.models import builtin_model

    _use_preset(preset)
    pipe = builtin_model("tiny-sdxl").build()
    encoders = _text_encoders(pipe) if text_encoders else None
    network = create_network(
        1.0, rank, alpha, None, encoders, pipe.unet, preset=PRESET_NAME, conv_dim=rank, conv_alpha=alpha, **kind
    )
    network.apply_to(encoders, pipe.unet, text_encoders, True)
    _draw(network.named_parameters(), torch.Generator().manual_seed(seed), std)
    network.save_weights(str(path), torch.float32, None)
    return path


@torch.no_grad()
def _draw(parameters, generator: torch.Generator, std: float, *, whole_weights: bool = False) -> None:
    """Every trainable tensor at random: magnitudes around their start, full differences small, factors at `std`.
    `whole_weights`: the parameters named (or ending in) weight/bias are full modules' whole weights."""
    for name, parameter in parameters:
        noise = torch.randn(parameter.shape, generator=generator)
        if name.endswith("dora_scale"):
            parameter.mul_(1 + 0.2 * noise)
        elif name.endswith(("diff", "diff_b")) or (whole_weights and name.rpartition(".")[2] in ("weight", "bias")):
            parameter.add_(0.1 * std * noise)
        else:
            parameter.copy_(std * noise)


# kind -> (LyCORIS module, its keywords), for layers written one by one: those no LyCORIS network names (Flux's
# original BFL layers, some stacked by rows) or that its loader cannot read back (a DoRA normalised per column).
MODULE_KINDS = {
    "lora": ("locon", {}),
    "loha": ("loha", {}),
    "lokr": ("lokr", {"factor": 4}),  # w1 is 4 rows: q, k, v of a stacked qkv are no whole rows of it
    "lokr-whole": ("lokr", {"factor": 4, "full_matrix": True}),
    "full": ("full", {}),
    "dora": ("locon", {"weight_decompose": True}),
    "loha-dora": ("loha", {"weight_decompose": True}),
    "dora-columns": ("locon", {"weight_decompose": True, "wd_on_out": False}),
}


def lycoris_module(kind: str, name: str, layer: torch.nn.Module, *, seed: int, std: float = 0.3, rank: int = 4,
                   alpha: float = 2.0):  # fmt: skip
    """A LyCORIS module of `kind` (MODULE_KINDS) on `layer`, as its file names it `name`, its tensors drawn at
    random and applied: calling it (or the layer) computes the layer with the adapter, at `module.multiplier`."""
    from lycoris.modules.full import FullModule
    from lycoris.modules.locon import LoConModule
    from lycoris.modules.loha import LohaModule
    from lycoris.modules.lokr import LokrModule

    algo, keywords = MODULE_KINDS[kind]
    cls = {"locon": LoConModule, "loha": LohaModule, "lokr": LokrModule, "full": FullModule}[algo]
    module = cls(name, layer, 1.0, rank, alpha, **keywords)
    _draw(module.named_parameters(), torch.Generator().manual_seed(seed), std, whole_weights=algo == "full")
    module.apply_to()
    return module


def module_tensors(modules: dict) -> dict[str, torch.Tensor]:
    """The file of these LyCORIS modules (file name -> module): `<name>.<tensor>` as LyCORIS saves them."""
    return {
        f"{name}.{key}": tensor.detach().to(torch.float32).contiguous()
        for name, module in modules.items()
        for key, tensor in module.state_dict().items()
    }


def applied_network(path: Path, pipe, multiplier: float, preset: dict = TEST_PRESET, *, text_encoders: bool = True):
    """The LyCORIS network of the file applied to `pipe` (its modules' forwards now compute the adapter);
    `text_encoders=False` applies its UNet layers only."""
    from lycoris.kohya import create_network_from_weights

    _use_preset(preset)
    network, _ = create_network_from_weights(multiplier, str(path), None, _text_encoders(pipe), pipe.unet)
    network.apply_to(_text_encoders(pipe), pipe.unet, text_encoders, True)
    return network


COMPONENT_OF_PREFIX = {"lora_unet": "unet", "lora_te1": "text_encoder", "lora_te2": "text_encoder_2"}


def network_modules(network, pipe) -> dict[tuple[str, str], torch.nn.Module]:
    """(component, module path) -> the original module each LyCORIS module of the network wraps."""
    paths = {
        id(module): (component, name)
        for component in COMPONENT_OF_PREFIX.values()
        for name, module in getattr(pipe, component).named_modules()
    }
    return {
        paths[id(lora.org_module[0])]: lora.org_module[0] for lora in network.unet_loras + network.text_encoder_loras
    }


def probe(module: torch.nn.Module, generator: torch.Generator) -> torch.Tensor:
    """A random input for a linear or conv module."""
    if isinstance(module, torch.nn.Linear):
        return torch.randn(3, module.in_features, generator=generator)
    return torch.randn(1, module.in_channels, 6, 6, generator=generator)


# The newer families' transformers, through LyCORIS's general network (`lycoris.create_lycoris`, as SimpleTuner and
# LyCORIS's own scripts train them), which names layers `lycoris_<transformer module path>`. Each preset names the
# family's block classes (LyCORIS's "full" preset names Qwen-Image's and Z-Image's, none of FLUX.2's) and input
# projections outside them by path. The transformers hold linear layers only: no conv, so no Tucker kinds.
TRANSFORMER_PRESETS = {
    "qwen-image": dict(target_module=["QwenImageTransformerBlock"], target_name=["img_in", "txt_in"]),
    "z-image": dict(target_module=["ZImageTransformerBlock"], target_name=["cap_embedder.1"]),
    "flux2": dict(
        target_module=["Flux2TransformerBlock", "Flux2SingleTransformerBlock"],
        target_name=["x_embedder", "context_embedder"],
    ),
}
# Every other preset key, given each time: the network keeps the last preset's as class state.
_TRANSFORMER_PRESET_REST = dict(
    enable_conv=False, module_algo_map={}, name_algo_map={}, lora_prefix="lycoris", use_fnmatch=False, exclude_name=[]
)
TRANSFORMER_PRESET_NAME = "loraswap-tests-transformer"
# name -> create_lycoris keywords: one file per kind that applies to linear layers.
TRANSFORMER_KINDS = {
    "lora": dict(algo="lora"),
    "loha": dict(algo="loha"),
    "lokr": dict(algo="lokr", factor=4),
    "lokr-whole": dict(algo="lokr", factor=4, full_matrix=True),  # both factors whole: alpha must not scale them
    "full": dict(algo="full"),
    "dora": dict(algo="lora", dora_wd=True),
    "loha-dora": dict(algo="loha", dora_wd=True),
}


def write_transformer_lycoris_file(path: Path, transformer: torch.nn.Module, kind: dict, preset: dict, *, seed: int,
                                   std: float = 0.3, rank: int = 4, alpha: float = 2.0) -> Path:  # fmt: skip
    """Write one LyCORIS file of `kind` (create_lycoris keywords) for the layers of `transformer` that `preset`
    (TRANSFORMER_PRESETS' keys) names, as the general network saves them; the transformer is left as it was."""
    from lycoris import create_lycoris
    from lycoris.config import PRESET

    PRESET[TRANSFORMER_PRESET_NAME] = {**_TRANSFORMER_PRESET_REST, **preset}
    network = create_lycoris(transformer, 1.0, rank, alpha, preset=TRANSFORMER_PRESET_NAME, **kind)
    network.apply_to()  # registers the modules, whose state the file is
    _draw(network.named_parameters(), torch.Generator().manual_seed(seed), std, whole_weights=kind["algo"] == "full")
    network.save_weights(str(path), torch.float32, None)
    network.restore()
    return path


def applied_transformer_network(path: Path, transformer: torch.nn.Module, multiplier: float):
    """The general LyCORIS network of the file applied to `transformer` (its modules' forwards now compute the
    adapter at `multiplier`). The file's layer names say which modules; of a preset only the prefix counts."""
    from lycoris import create_lycoris_from_weights
    from lycoris.wrapper import LycorisNetwork

    LycorisNetwork.apply_preset({"lora_prefix": _TRANSFORMER_PRESET_REST["lora_prefix"]})
    network, _ = create_lycoris_from_weights(multiplier, str(path), transformer)
    network.apply_to()
    return network
