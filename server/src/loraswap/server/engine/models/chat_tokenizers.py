"""Offline byte-level BPE tokenizers, with chat templates, for the Qwen and Mistral text encoders of the built-ins.

Qwen-Image, Z-Image and FLUX.2 [klein] read prompts through Qwen tokenizers (``Qwen2Tokenizer``), FLUX.2 [dev]
through Mistral's tekken one. These are built in memory as tokenizers.py builds CLIP's and T5's: the 256
byte characters of GPT-2's byte-level BPE, so any text tokenises, plus a few whole words as single tokens,
made by a chain of merges. The words are those of the text each pipeline always puts around a prompt (a
system prompt, a chat template), which keeps that text as few tokens as the real tokenizers make it:
Qwen-Image drops exactly 34 template tokens from what it encodes, and FLUX.2 [dev] prepends a system prompt
that must leave room for the prompt within the sequence length.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

from loraswap.server.engine.models.tokenizers import bytes_to_unicode

__all__ = [
    "MISTRAL_CHAT_TEMPLATE",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN_IMAGE_SYSTEM_PROMPT",
    "build_mistral_tokenizer",
    "build_qwen2_tokenizer",
    "flux2_dev_tokenizer",
    "qwen3_chat_tokenizer",
    "qwen_image_tokenizer",
]

_BYTE_CHARACTERS = bytes_to_unicode()

# Qwen2.5-VL's and Qwen3's special tokens, in their order (ids follow the byte vocabulary and the words here).
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
# Qwen3's thinking markers: added tokens, not special ones (decoding keeps them).
QWEN3_THINK = ("<think>", "</think>")
# The roles of a Qwen chat turn: single tokens, as in the real vocabulary.
QWEN_ROLES = ("system", "user", "assistant")

# Qwen3's chat template reduced to what the pipelines ask of it (user turns, add_generation_prompt, enable_thinking):
# the same text as the real template gives for those inputs.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# QwenImagePipeline's system prompt (its prompt_template_encode): every word one token, so that the template
# before the prompt is the 34 tokens (prompt_template_encode_start_idx) the pipeline drops, as with Qwen2.5-VL's.
QWEN_IMAGE_SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the "
    "objects and background:"
)

# Mistral-Small-3.1's control tokens at their tekken ids: <unk> 0, <s> 1, </s> 2, [IMG] 10, <pad> 11, ...
MISTRAL_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
)  # fmt: skip
# Mistral-Small-3.1's chat template reduced to text content (system and user turns), as Flux2Pipeline formats them.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
# tekken's pre-tokenisation: letters with at most one leading non-letter, single digits, punctuation runs, spaces.
_TEKKEN_SPLIT = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _words(text: str) -> tuple[str, ...]:
    """The letter runs of `text` as both pre-tokenisers cut them (a leading space kept), each once, in order."""
    return tuple(dict.fromkeys(re.findall(r" ?[A-Za-z]+", text)))


def _byte_level(text: str) -> str:
    return "".join(_BYTE_CHARACTERS[byte] for byte in text.encode("utf-8"))


def _bpe_vocab_and_merges(words: Iterable[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The 256 byte characters, plus each of `words` as one token made by a left-to-right chain of merges.

    A word meant to follow a space is given with it (" the"), as BPE sees it after pre-tokenisation.
    """
    vocab = {character: index for index, character in enumerate(_BYTE_CHARACTERS)}
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = _byte_level(word)
        for end in range(1, len(pieces)):
            merged = pieces[: end + 1]
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((pieces[:end], pieces[end]))
    return vocab, merges


def build_qwen2_tokenizer(words: Iterable[str] = (), chat_template: str | None = None) -> Qwen2Tokenizer:
    """A ``Qwen2Tokenizer`` (Qwen's pre-tokeniser, byte-level vocabulary, special tokens) with `words` as whole tokens.

    Its eos is ``<|im_end|>`` and its pad ``<|endoftext|>``, as Qwen2.5-VL's and Qwen3's tokenizers have them.
    """
    vocab, merges = _bpe_vocab_and_merges((*QWEN_ROLES, *words))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=32768,
    )  # fmt: skip
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_THINK])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def qwen_image_tokenizer() -> Qwen2Tokenizer:
    """Qwen-Image's tokenizer: the words of its system prompt are single tokens (the pipeline drops the template)."""
    return build_qwen2_tokenizer(_words(QWEN_IMAGE_SYSTEM_PROMPT))


def qwen3_chat_tokenizer() -> Qwen2Tokenizer:
    """Z-Image's and FLUX.2 [klein]'s tokenizer: Qwen3's, with its chat template (the pipelines format prompts so)."""
    return build_qwen2_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)


def build_mistral_tokenizer(words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """A tekken-like byte-level BPE tokenizer with Mistral's control tokens first and its chat template."""
    byte_vocab, merges = _bpe_vocab_and_merges(words)
    vocab = {token: index for index, token in enumerate(MISTRAL_SPECIALS)}
    vocab.update({token: index + len(MISTRAL_SPECIALS) for token, index in byte_vocab.items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_TEKKEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=131072,
    )  # fmt: skip
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def flux2_dev_tokenizer() -> PreTrainedTokenizerFast:
    """FLUX.2 [dev]'s tokenizer stand-in: the words of the system prompt Flux2Pipeline prepends are single tokens.

    The real one is a ``PixtralProcessor``, which transformers builds only with torchvision installed; the
    pipeline asks of it only ``apply_chat_template`` (unless caption upsampling is asked for), which this answers.
    """
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return build_mistral_tokenizer(_words(SYSTEM_MESSAGE))
