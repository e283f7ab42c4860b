"""Which base model an adapter was made for, and whether the served model is one it fits.

Adapters declare their base in several dialects: a Hub repo id (safetensors metadata
`base_model`, or the `base_model` field of a model card's YAML front matter), a ModelSpec
architecture (`modelspec.architecture`, e.g. "stable-diffusion-xl-v1-base/lora", "flux-1-dev/lora")
or kohya's `ss_base_model_version` (e.g. "sdxl_base_v1-0", "flux1"). Every declaration is
normalised here, through one table, onto one vocabulary: the Hub repo id of the base model
(e.g. "black-forest-labs/FLUX.1-dev"), or, where a declaration names a family but not a model
(kohya's "flux1", ModelSpec's "flux-1"), the family's name ("flux1").

How compatibility is judged:
- Each known model belongs to a compatibility group: models of one architecture and lineage whose
  LoRAs are commonly used on one another (FLUX.1-dev and FLUX.1-schnell; SD 1.4 and 1.5). A
  declaration fits the served model when both are in one group, or name the same model.
- A family name fits any served model of its group ("flux1" fits FLUX.1-dev and FLUX.1-schnell).
- A model the table does not know (a fine-tune, a local folder) is a group of its own: only the
  same id fits it. `--allow-base X` makes the server accept what it would accept if it served X.
- An adapter must fit by every declaration it makes; a model card may list several bases, of which
  one fitting is enough. An adapter that declares nothing is accepted.

Declarations are untrusted input: only the safetensors header (never the tensors) and the start of
the model card are read. A header or card that cannot be parsed declares nothing (the tensor reader
refuses a broken file on its own); a declaration that is there but is not text, or is longer than
any model id, is refused as ADAPTER_BAD_METADATA.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.adapters.sources.safetensors_file import read_safetensors_metadata
from loraswap.server.engine.errors import AdapterFormatError, BaseModelMismatchError, ErrorReason, shorten

# Hub repo ids are at most 96 characters; ModelSpec and kohya values are shorter still.
MAX_DECLARATION_CHARS = 256
# A model card may list several bases (a merge's parents); more than this is not a declaration.
MAX_CARD_BASES = 16
# The model card's front matter is at its top; nothing past this is read.
MAX_CARD_BYTES = 256 * 1024
# The `base_model` lines of a card: MAX_CARD_BASES ids with room to spare.
MAX_CARD_DECLARATION_CHARS = 8 * 1024

SOURCE_BASE_MODEL = "safetensors:base_model"
SOURCE_MODELSPEC = "safetensors:modelspec.architecture"
SOURCE_KOHYA = "safetensors:ss_base_model_version"
SOURCE_MODEL_CARD = "README.md:base_model"
_CARD_KEY = re.compile(r"^(['\"]?)base_model\1[ \t]*:", re.MULTILINE)
# The safetensors metadata keys read, with the source each is reported as.
_METADATA_KEYS = {
    "base_model": SOURCE_BASE_MODEL,
    "modelspec.architecture": SOURCE_MODELSPEC,
    "ss_base_model_version": SOURCE_KOHYA,
}

SDXL_BASE = "stabilityai/stable-diffusion-xl-base-1.0"
FLUX_DEV = "black-forest-labs/FLUX.1-dev"
FLUX_SCHNELL = "black-forest-labs/FLUX.1-schnell"
QWEN_IMAGE = "Qwen/Qwen-Image"
Z_IMAGE_TURBO = "Tongyi-MAI/Z-Image-Turbo"
FLUX2_DEV = "black-forest-labs/FLUX.2-dev"
FLUX2_KLEIN_4B = "black-forest-labs/FLUX.2-klein-4B"


@dataclass(frozen=True)
class BaseModel:
    """A base model in the one vocabulary: a Hub repo id (or a family name), and its compatibility group."""

    id: str
    group: str | None = None  # None: compatible with itself only

    def fits(self, other: BaseModel) -> bool:
        """Whether an adapter made for this base works on `other` (symmetric)."""
        if _key(self.id) == _key(other.id):
            return True
        return self.group is not None and self.group == other.group


@dataclass(frozen=True)
class _KnownBase:
    id: str
    group: str
    # Other spellings that name exactly this model (or, for a family name, the family): aliases on the
    # Hub, ModelSpec architectures (without their "/lora" suffix), kohya's ss_base_model_version values.
    spellings: tuple[str, ...] = ()


# The one table. Sources: ModelSpec (Stability-AI/ModelSpec and kohya's sai_model_spec.py architecture
# ids), kohya sd-scripts' ss_base_model_version values, and the Hub ids of the base models.
_KNOWN_BASES: tuple[_KnownBase, ...] = (
    _KnownBase(SDXL_BASE, "sdxl", ("stable-diffusion-xl-v1-base", "sdxl_base_v1-0")),
    _KnownBase("stabilityai/stable-diffusion-xl-base-0.9", "sdxl", ("stable-diffusion-xl-v0_9-base",)),
    _KnownBase("sdxl", "sdxl"),
    # The refiner's UNet is another network: base LoRAs do not fit it.
    _KnownBase(
        "stabilityai/stable-diffusion-xl-refiner-1.0", "sdxl-refiner",
        ("stable-diffusion-xl-v1-refiner", "stable-diffusion-xl-v0_9-refiner"),
    ),
    _KnownBase(FLUX_DEV, "flux1", ("flux-1-dev",)),
    _KnownBase(FLUX_SCHNELL, "flux1", ("flux-1-schnell",)),
    _KnownBase("flux1", "flux1", ("flux-1",)),
    # Qwen-Image's text-to-image releases share one transformer; the Edit models are trained on other inputs.
    _KnownBase(QWEN_IMAGE, "qwen-image", ("qwen-image", "qwen_image")),
    _KnownBase("Qwen/Qwen-Image-2512", "qwen-image"),
    _KnownBase("Qwen/Qwen-Image-Edit", "qwen-image-edit", ("qwen-image-edit", "qwen_image_edit")),
    # musubi-tuner's ModelSpec architectures: "Qwen-Image-Edit-Plus" is 2509's (QwenImageEditPlusPipeline).
    _KnownBase("Qwen/Qwen-Image-Edit-2509", "qwen-image-edit", ("qwen-image-edit-plus", "qwen-image-edit-2509")),
    _KnownBase("Qwen/Qwen-Image-Edit-2511", "qwen-image-edit", ("qwen-image-edit-2511",)),
    # Turbo is distilled from Base with the same transformer: LoRAs trained on either are used on both.
    _KnownBase(Z_IMAGE_TURBO, "z-image", ("z-image-turbo", "z_image_turbo")),
    _KnownBase("Tongyi-MAI/Z-Image", "z-image", ("z-image", "z_image")),
    # FLUX.2's sizes are different networks (widths 6144, 3072, 4096): a LoRA fits its own size only.
    # ("Flux.2-dev", "Flux.2-klein-4b", ... are musubi-tuner's ModelSpec architectures.)
    _KnownBase(FLUX2_DEV, "flux2-dev", ("flux-2-dev", "flux2-dev")),
    _KnownBase(FLUX2_KLEIN_4B, "flux2-klein-4b", ("flux-2-klein-4b", "flux2-klein-4b")),
    _KnownBase("black-forest-labs/FLUX.2-klein-base-4B", "flux2-klein-4b", ("flux-2-klein-base-4b",)),
    _KnownBase("black-forest-labs/FLUX.2-klein-9B", "flux2-klein-9b", ("flux-2-klein-9b", "flux2-klein-9b")),
    _KnownBase("black-forest-labs/FLUX.2-klein-base-9B", "flux2-klein-9b", ("flux-2-klein-base-9b",)),
    # Chroma is pruned from FLUX.1-schnell (no modulation layers): FLUX.1 LoRAs do not fit it.
    _KnownBase("lodestones/Chroma", "chroma", ("chroma",)),
    _KnownBase(
        "stable-diffusion-v1-5/stable-diffusion-v1-5", "sd1",
        ("runwayml/stable-diffusion-v1-5", "sd-legacy/stable-diffusion-v1-5"),
    ),
    _KnownBase("CompVis/stable-diffusion-v1-4", "sd1"),
    _KnownBase("sd1", "sd1", ("stable-diffusion-v1", "sd_v1", "sd_v1_v")),
    _KnownBase("stabilityai/stable-diffusion-2-1", "sd2", ("stable-diffusion-v2-768-v",)),
    _KnownBase("stabilityai/stable-diffusion-2-1-base", "sd2", ("stable-diffusion-v2-512",)),
    _KnownBase("sd2", "sd2", ("stable-diffusion-v2", "sd_v2", "sd_v2_v")),
)  # fmt: skip

_HUB_PREFIXES = ("hf:", "https://huggingface.co/", "huggingface.co/")
# What ModelSpec writes after the architecture and a slash: the kind of adapter, not part of the base.
_MODELSPEC_ADAPTER_KINDS = frozenset({"lora", "lycoris", "loha", "lokr", "dora", "textual-inversion"})


def _key(text: str) -> str:
    """What spellings of one name share: case, and '.' / '_' / '-' as separators, do not count."""
    return re.sub(r"[._\s]+", "-", text.strip().lower())


_BY_SPELLING: dict[str, BaseModel] = {
    _key(spelling): BaseModel(known.id, known.group)
    for known in _KNOWN_BASES
    for spelling in (known.id, *known.spellings)
}


def normalise(declared: str) -> BaseModel:
    """The base model a declaration names, in the one vocabulary.

    A Hub id, a ModelSpec architecture (any "/lora"-style adapter suffix ignored) or a kohya
    version; what the table does not know is taken as a Hub id of its own (verbatim, trimmed).
    """
    text = declared.strip()
    lowered = text.lower()
    for prefix in _HUB_PREFIXES:
        if lowered.startswith(prefix):
            text = text[len(prefix) :].strip("/")
            break
    architecture, _, kind = text.partition("/")
    if _key(kind) in _MODELSPEC_ADAPTER_KINDS:
        # A ModelSpec architecture carries the adapter kind after a slash: "flux-1-dev/lora".
        text = architecture
    known = _BY_SPELLING.get(_key(text))
    return known if known is not None else BaseModel(text)


@dataclass(frozen=True)
class BaseDeclaration:
    """One declaration an adapter makes: where it was read, what it says, and the base(s) it names."""

    source: str
    declared: str
    bases: tuple[BaseModel, ...]  # the adapter fits where any of them does

    @property
    def base_ids(self) -> str:
        return ", ".join(base.id for base in self.bases)


def _checked_value(value: object, source: str, adapter: str) -> str | None:
    """A declaration as text, None for an empty one; anything else is refused as bad metadata."""
    if not isinstance(value, str):
        raise AdapterFormatError(
            f"adapter {shorten(adapter)!r} declares its base model ({source}) as a {type(value).__name__}; "
            "it must be a model id such as " + SDXL_BASE,
            reason=ErrorReason.ADAPTER_BAD_METADATA,
        )
    if len(value) > MAX_DECLARATION_CHARS or not value.isprintable():
        raise AdapterFormatError(
            f"adapter {shorten(adapter)!r} declares its base model ({source}) as {shorten(value, 60)!r}, "
            f"which is not a model id (at most {MAX_DECLARATION_CHARS} printable characters); fix the adapter's "
            "metadata",
            reason=ErrorReason.ADAPTER_BAD_METADATA,
        )
    return value.strip() or None


def _card_base_model(path: Path, adapter: str) -> object:
    """The `base_model` value of a model card's YAML front matter; None when it has none or it cannot be parsed.

    Only that key's lines are parsed: the rest of the front matter (widgets, datasets, ...) never reaches the YAML
    parser, whose pure-Python scanner takes seconds on a few kilobytes of nested brackets.
    """
    import yaml

    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_CARD_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return None
    # The block huggingface_hub's ModelCard reads: a first line of '---', up to the next '---' line.
    front = re.match(r"\s*---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(\r?\n|$)", text, re.DOTALL)
    key = _CARD_KEY.search(front[1]) if front is not None else None
    if key is None:
        return None
    first, *rest = front[1][key.start() :].splitlines()
    # The key's value: its own line, then the indented or "- " lines that continue it.
    block = [first, *takewhile(lambda line: not line.strip() or line[:1] in (" ", "\t", "-"), rest)]
    snippet = "\n".join(block)
    if len(snippet) > MAX_CARD_DECLARATION_CHARS or "{" in snippet or snippet.count("[") > 1:
        raise AdapterFormatError(
            f"adapter {shorten(adapter)!r} declares its base model ({SOURCE_MODEL_CARD}) as something other than a "
            "model id or a short list of them; fix the model card's front matter",
            reason=ErrorReason.ADAPTER_BAD_METADATA,
        )
    try:
        # Aliases are what makes a few bytes of YAML expand without bound; an honest declaration has none.
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(snippet, Loader=yaml.SafeLoader)):
            return None
        data = yaml.safe_load(snippet)
    # A card is prose for people: one that does not parse declares nothing.
    except (yaml.YAMLError, RecursionError, ValueError):
        return None
    return data.get("base_model") if isinstance(data, dict) else None


def read_declarations(adapter_file: AdapterFile) -> tuple[BaseDeclaration, ...]:
    """Every base-model declaration of an adapter: its safetensors metadata, then its model card."""
    declarations = []
    metadata = read_safetensors_metadata(adapter_file.path, adapter_file.max_bytes)
    for key, source in _METADATA_KEYS.items():
        if key in metadata:
            value = _checked_value(metadata[key], source, adapter_file.name)
            if value is not None:
                declarations.append(BaseDeclaration(source, value, (normalise(value),)))
    if adapter_file.model_card is not None:
        value = _card_base_model(adapter_file.model_card, adapter_file.name)
        if isinstance(value, list):
            if len(value) > MAX_CARD_BASES:
                raise AdapterFormatError(
                    f"adapter {shorten(adapter_file.name)!r} lists {len(value)} base models in its model card; "
                    f"at most {MAX_CARD_BASES} are read",
                    reason=ErrorReason.ADAPTER_BAD_METADATA,
                )
            values = [_checked_value(item, SOURCE_MODEL_CARD, adapter_file.name) for item in value]
            values = [item for item in values if item is not None]
        elif value is not None:
            values = [v for v in (_checked_value(value, SOURCE_MODEL_CARD, adapter_file.name),) if v is not None]
        else:
            values = []
        if values:
            declarations.append(
                BaseDeclaration(SOURCE_MODEL_CARD, ", ".join(values), tuple(normalise(v) for v in values))
            )
    return tuple(declarations)


class BaseModelPolicy:
    """The served base and the further bases --allow-base accepts; checks adapters before they are loaded."""

    def __init__(self, served: str, allowed: Iterable[str] = ()) -> None:
        self.served = normalise(served)
        self.allowed = tuple(normalise(base) for base in allowed if base.strip())

    def accepts(self, declaration: BaseDeclaration) -> bool:
        """Whether some base the declaration names fits the served model or an allowed one."""
        targets = (self.served, *self.allowed)
        return any(base.fits(target) for base in declaration.bases for target in targets)

    def check(self, adapter_file: AdapterFile) -> None:
        """Refuse, with BaseModelMismatchError, an adapter that declares a base this server does not serve.

        Reads the safetensors header and the model card only, never the tensors.
        """
        for declaration in read_declarations(adapter_file):
            if self.accepts(declaration):
                continue
            served = self.served.id
            raise BaseModelMismatchError(
                f"adapter {shorten(adapter_file.name)!r} was made for {shorten(declaration.base_ids, 120)} "
                f"({declaration.source} says {shorten(declaration.declared, 80)!r}), but this server serves "
                f"{served}; use an adapter made for {served}, or, if it works on {served}, restart the server "
                f"with --allow-base {shorten(declaration.bases[0].id, 120)}",
                adapter_base=declaration.base_ids,
                served_base=served,
                source=declaration.source,
            )
