"""What an engine needs to take images for the tiny Qwen4Exp: a tokenizer, a processor, pictures.

SGLang serves image requests of a Qwen-VL model only with its tokenizer and Hugging Face processor
loaded (``skip_tokenizer_init=False``): the request's token ids are decoded to text, the processor
expands each ``<|vision_start|><|image_pad|><|vision_end|>`` into one ``<|image_pad|>`` per merged
patch and tokenizes the text again. The tokenizer made here keeps that round trip exact for any
ids (a byte-level BPE, the kind transformers imposes on this model type, in which every ordinary
id is one two-byte character of its own), and the vision ids are special tokens at the config's
ids. The image processor is the Qwen2-VL one with the tiny vision tower's patch and merge sizes,
so a 64 × 64 picture becomes a ``(1, 4, 4)`` grid of 16 patches and 4 image tokens.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Mapping
from typing import Any, Final

from qsa_testing._errors import ModelSpecError

__all__ = ("merged_patch_pixels", "processor_files", "tiny_image")

#: Ordinary id ``i`` is the character ``U+0100 + i``: two UTF-8 bytes up to ``U+07FF``.
_FIRST_CHAR: Final = 0x100
_LAST_TWO_BYTE_CHAR: Final = 0x7FF
#: Special tokens the model's ids name, by their ``config.json`` field.
_VISION_TOKENS: Final = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
_PAD, _BOS, _EOS = "<|pad|>", "<|bos|>", "<|eos|>"
#: Per-channel mean and standard deviation the image processor normalises with.
_IMAGE_MEAN: Final = [0.5, 0.5, 0.5]


def _specials(config: Mapping[str, Any]) -> dict[int, str]:
    text = config["text_config"]
    specials = {0: _PAD, int(text["bos_token_id"]): _BOS, int(text["eos_token_id"]): _EOS}
    specials.update({int(config[field]): token for field, token in _VISION_TOKENS.items()})
    return specials


def _byte_chars() -> list[str]:
    """The byte-level alphabet: the printable character that stands for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _tokenizer_json(config: Mapping[str, Any]) -> str:
    """A byte-level BPE (the Qwen tokenizers' kind) in which id ``i`` is the character ``U+0100+i``.

    Each such character is two UTF-8 bytes, merged into one token by one rule; a lead byte never
    ends a token and a continuation byte never starts one, so no rule applies across two tokens
    and any sequence of ids decodes to text that encodes back to the same ids. The single-byte
    pieces sit above the model's vocabulary: merging always completes, so no id past it is ever
    produced.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = _specials(config)
    size = int(config["text_config"]["vocab_size"])
    if _FIRST_CHAR + size - 1 > _LAST_TWO_BYTE_CHAR:
        msg = (
            f"vocab_size={size!r} is not allowed for the tiny tokenizer; allowed: at most "
            f"{_LAST_TWO_BYTE_CHAR - _FIRST_CHAR + 1!r} (one two-byte character per id)"
        )
        raise ModelSpecError(msg)
    byte_char = _byte_chars()
    vocab = {token: i for i, token in specials.items()}
    merges: list[tuple[str, str]] = []
    pieces: dict[str, int] = {}
    for i in range(size):
        if i in specials:
            continue
        lead, cont = (byte_char[b] for b in chr(_FIRST_CHAR + i).encode("utf-8"))
        for piece in (lead, cont):
            pieces.setdefault(piece, size + len(pieces))
        vocab[lead + cont] = i
        merges.append((lead, cont))
    vocab.update(pieces)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
    text: str = tokenizer.to_str()
    return text


def merged_patch_pixels(config: Mapping[str, Any]) -> int:
    """Pixels per side of one image token: the vision tower's patch size × spatial merge size."""
    vision = config["vision_config"]
    return int(vision["patch_size"]) * int(vision["spatial_merge_size"])


def processor_files(config: Mapping[str, Any]) -> dict[str, str]:
    """The tokenizer and processor files of a tiny Qwen4Exp, by file name, as text.

    Args:
        config: the model's ``config.json`` content (vision token ids, ``vision_config``).
    """
    vision = config["vision_config"]
    unit = merged_patch_pixels(config)
    pixels = {  # what the image and the video processor share: patching, sizes, normalisation
        "patch_size": int(vision["patch_size"]),
        "merge_size": int(vision["spatial_merge_size"]),
        "temporal_patch_size": int(vision["temporal_patch_size"]),
        "size": {"shortest_edge": unit * unit, "longest_edge": 64 * unit * unit},
        "image_mean": _IMAGE_MEAN,
        "image_std": _IMAGE_MEAN,
        "processor_class": "Qwen3VLProcessor",
    }
    files: dict[str, Any] = {
        "tokenizer_config.json": {
            "tokenizer_class": "TokenizersBackend",
            "model_max_length": int(config["text_config"]["max_position_embeddings"]),
            "pad_token": _PAD,
            "bos_token": _BOS,
            "eos_token": _EOS,
            "clean_up_tokenization_spaces": False,
        },
        "preprocessor_config.json": {
            **pixels,
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
        },
        "video_preprocessor_config.json": {
            **pixels,
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
        "processor_config.json": {"processor_class": "Qwen3VLProcessor"},
    }
    texts = {name: json.dumps(body, indent=1, sort_keys=True) for name, body in files.items()}
    texts["tokenizer.json"] = _tokenizer_json(config)
    return texts


def tiny_image(seed: int, *, width: int = 64, height: int = 64) -> str:
    """A random RGB picture as a ``data:image/png;base64,...`` URL (what ``image_data`` takes)."""
    from PIL import Image

    rng = random.Random(seed)
    pixels = bytes(rng.randrange(256) for _ in range(width * height * 3))
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
