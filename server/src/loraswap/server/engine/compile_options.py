"""What `--compile` and `--compile-mode` may say, and what a runtime makes of them. Plain values, no torch.

`--compile` chooses how much of the denoiser torch.compile covers: `full` (the whole
denoiser, one graph per shape class), `regional` (only its repeated blocks, diffusers'
`compile_repeated_blocks`: one graph per block type, reused by every block, so compiling
costs a fraction while the steps run nearly as fast) or `none`. `--compile-mode` is
torch.compile's `mode` for the inductor backend.
"""

from __future__ import annotations

COMPILE_KINDS = ("none", "full", "regional")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The modes that add CUDA graphs, and what they are without them (inductor has no CPU graphs to capture).
CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
# The old on/off switch: --compile / --no-compile and LORASWAP_COMPILE=true/false.
_SWITCH_FORMS = {
    "true": "full", "1": "full", "yes": "full", "on": "full",
    "false": "none", "0": "none", "no": "none", "off": "none",
}  # fmt: skip


def normalize_compile(value: str | bool | None) -> str | None:
    """`--compile`'s value as a kind: True/False (the old switch) are full/none; None stays None (device decides).

    Strings are lower-cased and stripped; anything that is no kind is returned as given, for
    `compile_options_problem` to name.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return "full" if value else "none"
    text = value.strip().lower()
    return _SWITCH_FORMS.get(text, text)


def compile_options_problem(kind: str | None, mode: str, backend: str) -> str | None:
    """One line saying what to change, or None when `--compile`, `--compile-mode` and `--compile-backend` fit."""
    if kind is not None and kind not in COMPILE_KINDS:
        return f"--compile {kind!r} is not one of {', '.join(COMPILE_KINDS)} (--compile alone means full)"
    if mode not in COMPILE_MODES:
        return f"--compile-mode {mode!r} is not one of {', '.join(COMPILE_MODES)}"
    if mode != "default" and kind == "none":
        return f"--compile-mode {mode} needs a compiled denoiser: add --compile full or --compile regional"
    if mode != "default" and backend != "inductor":
        return f"--compile-mode {mode} is an inductor mode: use --compile-backend inductor or --compile-mode default"
    return None


def resolve_compile_kind(kind: str | None, device_type: str, family_kind: str = "full") -> str:
    """The kind a runtime uses: the configured one, or when unset the family's (`family_kind`: full but for Z-Image,
    regional) on CUDA and none elsewhere."""
    if kind is not None:
        return kind
    return family_kind if device_type == "cuda" else "none"


def effective_compile_mode(mode: str, device_type: str) -> str:
    """The mode a runtime compiles with: a CUDA-graph mode runs as its graph-free twin off CUDA."""
    if device_type != "cuda":
        return CUDA_GRAPH_MODES.get(mode, mode)
    return mode


def compile_mode_label(kind: str, mode: str) -> str:
    """What GetServerInfo.compile_mode says: `full/default`, `regional/max-autotune`, or `none`."""
    return "none" if kind == "none" else f"{kind}/{mode}"
