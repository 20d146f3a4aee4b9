"""The chunker's tokenizer without ``transformers`` (issue 22): the model folder's ``tokenizer.json``
loaded by the Rust ``tokenizers`` package, behind the small call surface the stages use.

Importing ``transformers`` to build a ``PreTrainedTokenizerFast`` took ~28 % of a one-changed-document
ingestion run (~1 s CPU in every ``ragline index`` and served ingestion run); the Rust package that
``transformers`` wraps loads the same file in milliseconds. ``PreTrainedTokenizerFast.from_pretrained``
encodes with exactly that Rust tokenizer, after switching off the truncation and padding a
``tokenizer.json`` may hold (MiniLM's: truncation at 128, padding to 128) and re-adding the added and
special tokens ``tokenizer_config.json`` names. ``load_chunking_tokenizer`` takes the shortcut only
where that leaves the tokenizer as the file has it: every setting of ``tokenizer_config.json`` is one
known not to change ids, offsets or word ids (``SAFE_CONFIG_KEYS``), and every token it names is
already an added token of ``tokenizer.json`` with the same properties. Anything else (a legacy
``added_tokens.json``, ``add_bos_token``, ``split_special_tokens``, a vocabulary over 100,000 entries,
which ``transformers`` may re-write the pre-tokenizer of) returns ``None``: the caller falls back to
``transformers``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

# tokenizer_config.json settings that PreTrainedTokenizerFast stores without touching the Rust tokenizer
# (BERT's casing and accent settings included: only BertTokenizer rebuilds its normalizer from them, and
# the chunker's tokenizer has never been that class) or that only truncation, padding and decoding read.
SAFE_CONFIG_KEYS = frozenset({
    "added_tokens_decoder", "additional_special_tokens", "extra_special_tokens",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "clean_up_tokenization_spaces", "do_basic_tokenize", "do_lower_case", "never_split", "strip_accents",
    "tokenize_chinese_chars", "wordpieces_prefix", "model_max_length", "max_length", "stride",
    "truncation_strategy", "truncation_side", "padding_side", "pad_to_multiple_of", "pad_token_type_id",
    "model_input_names", "name_or_path", "tokenizer_class", "chat_template",
})
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
LIST_SPECIAL_TOKENS = ("additional_special_tokens", "extra_special_tokens")
TOKEN_PROPERTIES = ("lstrip", "rstrip", "normalized", "single_word", "special")
MAX_VOCAB = 100_000  # transformers may patch the pre-tokenizer's regex of larger (Mistral) vocabularies


def load_chunking_tokenizer(folder: Path) -> ChunkingTokenizer | None:
    """The folder's ``tokenizer.json`` as a ``ChunkingTokenizer``, or None where the folder has none or
    its ``tokenizer_config.json`` asks for what this shortcut does not reproduce (see the module doc)."""
    path = folder / "tokenizer.json"
    if not path.is_file() or (folder / "added_tokens.json").exists():
        return None
    config = _json_object(folder / "tokenizer_config.json")
    special_map = _json_object(folder / "special_tokens_map.json")
    if config is None or special_map is None or set(config) - SAFE_CONFIG_KEYS:
        return None
    from tokenizers import Tokenizer  # imported where used: the stages' modules load without it

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - the Rust loader's errors are plain Exceptions; transformers says why
        return None
    if tokenizer.get_vocab_size(with_added_tokens=True) > MAX_VOCAB:
        return None
    added = tokenizer.get_added_tokens_decoder()
    if not _same_added_tokens(config.get("added_tokens_decoder") or {}, added):
        return None
    # from_pretrained reads special_tokens_map.json only when the config has no added_tokens_decoder
    named = [config] if "added_tokens_decoder" in config else [config, special_map]
    contents = {token.content for token in added.values()}
    if not all(_content(token) in contents for source in named for token in _special_tokens(source)):
        return None  # transformers would add it, as a special token (a new id, never split)
    return ChunkingTokenizer(tokenizer)


class ChunkingTokenizer:
    """A Rust ``tokenizers.Tokenizer`` called like the ``transformers`` tokenizers the stages use:
    ``tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, truncation=False,
    verbose=False)`` gives ``["input_ids"]``, ``["offset_mapping"]`` and ``word_ids(i)``, equal to
    ``PreTrainedTokenizerFast``'s for the same ``tokenizer.json``.

    Thread-safe, one per embedder: truncation and padding are switched off here, once, and nothing
    sets them again (a ``transformers`` fast tokenizer sets them on its Rust tokenizer at every call,
    which is what made sharing one unsafe); ``encode_batch`` only reads the tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer

    def __call__(self, text: str | list[str], *, add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False, truncation: bool = False,
                 verbose: bool = True) -> Encoded:
        del verbose  # transformers' warning about texts over the model's length: chunking reads them whole
        if truncation:
            raise ValueError("the chunking tokenizer does not truncate (chunks are cut by the chunker)")
        single = isinstance(text, str)
        encodings = self._tokenizer.encode_batch([text] if single else list(text),
                                                 add_special_tokens=add_special_tokens)
        return Encoded(encodings, single=single, offsets=return_offsets_mapping)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)


class Encoded:
    """The encodings of one call: ``["input_ids"]``, ``["offset_mapping"]`` (when asked for) and
    ``word_ids(i)``, per text of a batch, or of the one text when the call was given a string."""

    def __init__(self, encodings: list[Encoding], single: bool, offsets: bool):
        self._encodings = encodings
        self._single = single
        self._keys = ("input_ids", "offset_mapping") if offsets else ("input_ids",)
        self._rows: dict[str, list[Any]] = {}  # built once per key: the chunker indexes them per document

    def __getitem__(self, key: str) -> list[Any]:
        if key not in self._keys:
            raise KeyError(key)
        rows = self._rows.get(key)
        if rows is None:
            rows = [e.ids if key == "input_ids" else e.offsets for e in self._encodings]
            self._rows[key] = rows = rows[0] if self._single else rows
        return rows

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> tuple[str, ...]:
        return self._keys

    def word_ids(self, batch_index: int = 0) -> list[int | None]:
        return self._encodings[batch_index].word_ids


def _json_object(path: Path) -> dict | None:
    """The file's JSON object; {} where there is no file; None where it is not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _same_added_tokens(declared: object, added: dict) -> bool:
    """True when every token of the config's ``added_tokens_decoder`` is the tokenizer's added token of
    that id with the same properties (transformers re-adds each; an equal one changes nothing)."""
    from tokenizers import AddedToken

    if not isinstance(declared, dict):
        return False
    for index, token in declared.items():
        try:  # as transformers builds it, defaults included (an omitted "normalized" follows "special")
            want = AddedToken(**{k: v for k, v in token.items() if k != "__type"})
            have = added.get(int(index))
        except (AttributeError, TypeError, ValueError):
            return False
        if have is None or want.content != have.content \
                or any(getattr(want, key) != getattr(have, key) for key in TOKEN_PROPERTIES):
            return False
    return True


def _special_tokens(source: dict) -> list[object]:
    tokens = [source[key] for key in NAMED_SPECIAL_TOKENS if source.get(key) is not None]
    for key in LIST_SPECIAL_TOKENS:
        value = source.get(key)
        tokens.extend(value.values() if isinstance(value, dict) else value if isinstance(value, list) else
                      [] if value is None else [value])
    return tokens


def _content(token: object) -> object:
    return token.get("content") if isinstance(token, dict) else token
