"""Offline CLIP and T5 tokenizers for the built-in models, built in memory with no download.

Both cover every printable character.  The CLIP one has no merges, so each
character is a token.  The T5 one splits words into characters too, unless a
word is listed in ``words``: those become single pieces, which keeps short
captions short (the `shapes` model reads its whole caption in 16 tokens).
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import CLIPTokenizer, T5TokenizerFast

__all__ = ["CLIP_MAX_LENGTH", "build_clip_tokenizer", "build_t5_tokenizer", "bytes_to_unicode"]

CLIP_MAX_LENGTH = 77
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"


def bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte-to-printable-character table, in byte order (also Qwen's and Mistral's byte-level BPE)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )  # fmt: skip
    mapping: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra
            extra += 1
    return [chr(mapping[b]) for b in range(256)]


def _clip_vocab() -> dict[str, int]:
    # Same layout as the real CLIP vocab (bytes, then bytes + "</w>", then the
    # specials) minus all merges, so every byte sequence is representable.
    chars = bytes_to_unicode()
    tokens = chars + [c + "</w>" for c in chars] + [_BOS, _EOS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_clip_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP tokenizer without merges (one token per character)."""
    # transformers 5 builds the BPE backend straight from an in-memory vocab;
    # no merges means every (byte-level) character is its own token.
    return CLIPTokenizer(vocab=_clip_vocab(), merges=[], model_max_length=CLIP_MAX_LENGTH)


def _t5_vocab(words: Sequence[str]) -> list[tuple[str, float]]:
    chars = [c for c in string.printable if not c.isspace()]
    # Equal scores make Unigram prefer the single "▁x" piece over "▁" + "x".
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in chars]
    pieces += [("▁" + c, -3.0) for c in chars]
    # A whole word scores better than any split of it into characters.
    pieces += [("▁" + word, -1.0) for word in words if len(word) > 1]
    return pieces


def build_t5_tokenizer(words: Sequence[str] = ()) -> T5TokenizerFast:
    """A T5 (Unigram) tokenizer over printable characters, with each of `words` as one piece."""
    backend = Tokenizer(models.Unigram(_t5_vocab(words), unk_id=2, byte_fallback=False))
    # Same pre-tokenisation/decoding as transformers' own T5 tokenizer, so a
    # save/load round trip rebuilds an identical tokenizer.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    return T5TokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=512,  # as FLUX's T5 tokenizer; the pipeline truncates itself
    )
