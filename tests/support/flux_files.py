"""Flux adapter files of LyCORIS modules in the layouts model sites carry, on tiny-flux, and those modules' own
outputs and merged weights as the reference.

Each file layer is one of lycoris-lora's own modules (LoConModule, LohaModule, LokrModule, FullModule) on a linear:
- BFL names (`lora_unet_double_blocks_0_img_attn_qkv`, what sd-scripts and LyCORIS's kohya network write for the
  original Flux model): the linear is the BFL layer, stacked from the diffusers layers' weights by rows;
- ai-toolkit's (`lora_transformer_`) and LyCORIS's (`lycoris_`) diffusers names: the diffusers layer itself.
The stacking table is this module's own reading of diffusers' single-file converter at tiny-flux's widths.
"""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from loraswap.server.engine.models import builtin_model
from tests.support.lycoris_files import lycoris_module, module_tensors

H, MLP = 32, 128  # tiny-flux: inner width, single blocks' MLP width
Q, K, V = ((0, H),), ((H, 2 * H),), ((2 * H, 3 * H),)
ALL = None
# BFL layer -> [(diffusers layer, the BFL rows that are its rows, in its own order)].
BFL_LAYERS = {
    "double_blocks_0_img_attn_qkv": [("transformer_blocks.0.attn.to_q", Q), ("transformer_blocks.0.attn.to_k", K),
                                     ("transformer_blocks.0.attn.to_v", V)],
    "double_blocks_1_txt_attn_qkv": [("transformer_blocks.1.attn.add_q_proj", Q),
                                     ("transformer_blocks.1.attn.add_k_proj", K),
                                     ("transformer_blocks.1.attn.add_v_proj", V)],
    "double_blocks_0_img_attn_proj": [("transformer_blocks.0.attn.to_out.0", ALL)],
    "double_blocks_1_txt_mlp_0": [("transformer_blocks.1.ff_context.net.0.proj", ALL)],
    "double_blocks_0_txt_mod_lin": [("transformer_blocks.0.norm1_context.linear", ALL)],
    "single_blocks_1_linear1": [("single_transformer_blocks.1.attn.to_q", Q),
                                ("single_transformer_blocks.1.attn.to_k", K),
                                ("single_transformer_blocks.1.attn.to_v", V),
                                ("single_transformer_blocks.1.proj_mlp", ((3 * H, 3 * H + MLP),))],
    "single_blocks_0_linear2": [("single_transformer_blocks.0.proj_out", ALL)],
    "single_blocks_1_modulation_lin": [("single_transformer_blocks.1.norm.linear", ALL)],
    "img_in": [("x_embedder", ALL)],
    "time_in_in_layer": [("time_text_embed.timestep_embedder.linear_1", ALL)],
    "guidance_in_out_layer": [("time_text_embed.guidance_embedder.linear_2", ALL)],
    "final_layer_linear": [("proj_out", ALL)],
    "final_layer_adaLN_modulation_1": [("norm_out.linear", ((H, 2 * H), (0, H)))],  # BFL (shift, scale)
}  # fmt: skip
STACKED = {name for name, targets in BFL_LAYERS.items() if len(targets) > 1 or targets[0][1] is not ALL}


def _rows(targets, layer_rows: dict[str, int]):
    """(diffusers layer, its BFL rows) with ALL made explicit."""
    return [(module, rows if rows is not ALL else ((0, layer_rows[module]),)) for module, rows in targets]


def stacked_linear(transformer, targets) -> torch.nn.Linear:
    """The BFL layer as one linear: the diffusers layers' weights and biases at their BFL rows."""
    layers = {module: transformer.get_submodule(module) for module, _ in targets}
    targets = _rows(targets, {module: layer.out_features for module, layer in layers.items()})
    total = sum(stop - start for _, rows in targets for start, stop in rows)
    stacked = torch.nn.Linear(next(iter(layers.values())).in_features, total)
    with torch.no_grad():
        for module, rows in targets:
            offset = 0
            for start, stop in rows:
                stacked.weight[start:stop] = layers[module].weight[offset : offset + stop - start]
                stacked.bias[start:stop] = layers[module].bias[offset : offset + stop - start]
                offset += stop - start
    return stacked


class FluxFile:
    """A file of LyCORIS modules in one layout; the reference outputs of the layers it changes."""

    def __init__(self, path, layout: str, kinds: dict[str, str], seed: int) -> None:
        """`kinds`: BFL layer -> kind (for the ai-toolkit and LyCORIS layouts, each of its diffusers layers)."""
        transformer = builtin_model("tiny-flux").build().transformer
        self.layers = {}  # file layer -> (module, [(diffusers layer, BFL rows)])
        for index, (bfl, kind) in enumerate(sorted(kinds.items())):
            targets = BFL_LAYERS[bfl]
            if layout == "bfl":
                layer = stacked_linear(transformer, targets)
                self._add(f"lora_unet_{bfl}", kind, layer, targets, seed + index, transformer)
                continue
            prefix = {"ai-toolkit": "lora_transformer", "lycoris": "lycoris"}[layout]
            for offset, (module, _) in enumerate(targets):
                layer = stacked_linear(transformer, [(module, ALL)])
                name = f"{prefix}_{module.replace('.', '_')}"
                self._add(name, kind, layer, [(module, ALL)], seed + 10 * index + offset, transformer)
        save_file(module_tensors({name: module for name, (module, _) in self.layers.items()}), str(path))

    def _add(self, name, kind, layer, targets, seed, transformer) -> None:
        rows = {module: transformer.get_submodule(module).out_features for module, _ in targets}
        self.layers[name] = (lycoris_module(kind, name, layer, seed=seed), _rows(targets, rows))

    @torch.no_grad()
    def expected(self, scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """diffusers layer -> (probe, its rows of the LyCORIS module's output at `scale`)."""
        generator = torch.Generator().manual_seed(0)
        outputs = {}
        for module, targets in self.layers.values():
            module.multiplier = scale
            x = torch.randn(3, module.org_module[0].in_features, generator=generator)
            y = module(x)
            for target, rows in targets:
                outputs[target] = (x, torch.cat([y[:, start:stop] for start, stop in rows], dim=1))
        return outputs

    @torch.no_grad()
    def merged_weights(self, scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """diffusers layer -> (weight, bias) the LyCORIS modules compute at `scale`, read off their outputs."""
        merged = {}
        for module, targets in self.layers.values():
            module.multiplier = scale
            width = module.org_module[0].in_features
            bias = module(torch.zeros(1, width))[0]
            weight = (module(torch.eye(width)) - bias).T
            for target, rows in targets:
                merged[target] = (torch.cat([weight[a:b] for a, b in rows]), torch.cat([bias[a:b] for a, b in rows]))
        return merged
