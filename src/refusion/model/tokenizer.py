"""refusion's own tokenizer: a model directory's `tokenizers.Tokenizer` with its special tokens and chat template,
read and written as transformers 5 does it, without importing transformers or torch.

Why: importing transformers takes seconds, and a cold `refusion generate` needs from a tokenizer only what is here
(encode, decode, the chat template, special tokens). `Tokenizer` answers each of those exactly as the
`transformers.AutoTokenizer` loaded from the same directory does (tests/model/test_tokenizer.py compares them),
because it runs the same steps on the same `tokenizers` backend:

1. read: `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`, `additional_chat_templates/*.jinja`,
   and for old directories `special_tokens_map.json` / `added_tokens.json` (`read_init_kwargs`, after
   transformers' `PreTrainedTokenizerBase._from_pretrained`);
2. build: the special tokens resolved and re-added to the backend in transformers' order (`Tokenizer.__init__`,
   after `TokenizersBackend.__init__`);
3. use: encode and decode on the backend, chat templates rendered in transformers' jinja sandbox;
4. save: the files transformers writes (`Tokenizer.save_pretrained`), which both libraries load back the same.

`supports(directory)` says when this holds: the directory has a `tokenizer.json` and transformers loads it with its
generic `TokenizersBackend`. A model-specific class (`tokenizer_class: "Qwen2Tokenizer"`, a sentencepiece model,
custom code) rebuilds the tokenizer its own way: then it gives the reason and the caller loads with transformers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
ADDED_TOKENS_FILE = "added_tokens.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
OTHER_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "tekken.json", "vocab.json", "vocab.txt", "merges.txt")
"""Files transformers builds a tokenizer from when there is no tokenizer.json (named in `supports`' reason)."""

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' `SPECIAL_TOKENS_ATTRIBUTES`, in its order (the order of `all_special_tokens`)."""
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_class` values that AutoTokenizer loads with the generic `TokenizersBackend` (the second is an alias)."""
FORCED_CLASS_MODEL_TYPES = frozenset({"hyperclovax_vision_v2", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text",
                                      "qwen4_exp", "siglip2"})
"""Model types for which AutoTokenizer (transformers 5.24) ignores a generic `tokenizer_class` and loads a class of
its own (`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` with a model-specific class; a test checks this set)."""
VERY_LARGE_INTEGER = int(1e30)
"""transformers' `model_max_length` when the config gives none."""
_SAVED_ATTRIBUTES = ("name_or_path", "backend", "model_max_length", "padding_side", "truncation_side",
                     "model_input_names", "clean_up_tokenization_spaces", "split_special_tokens", "chat_template",
                     "response_template", "chat_control_tokens", "verbose", "add_prefix_space", "vocab_size",
                     "is_fast", "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
"""Config keys that transformers' `save_pretrained` writes from the tokenizer's current attribute (the other keys
it writes back as it read them)."""


# 1. read ------------------------------------------------------------------------------------------------------

def supports(directory: str | os.PathLike) -> str | None:
    """None when `load_tokenizer(directory)` gives what `AutoTokenizer.from_pretrained(directory)` gives, else why
    not (then load the tokenizer with transformers)."""
    directory = Path(directory)
    if not (directory / TOKENIZER_FILE).is_file():
        others = [name for name in OTHER_TOKENIZER_FILES if (directory / name).is_file()]
        return f"{directory} has no {TOKENIZER_FILE}" + (f" (only {', '.join(others)})" if others else "")
    if not (directory / CONFIG_FILE).is_file():
        return f"{directory} has no {CONFIG_FILE}: transformers picks the tokenizer class from the model type"
    try:
        config = _read_json(directory / CONFIG_FILE)
    except ValueError:
        return None  # load_tokenizer names the damaged file
    tokenizer_class = config.get("tokenizer_class")
    if tokenizer_class is None:
        return f"{directory / CONFIG_FILE} names no tokenizer_class: transformers picks one from the model type"
    if tokenizer_class not in GENERIC_CLASSES:
        return (f"{directory / CONFIG_FILE} names tokenizer_class {tokenizer_class!r}, which transformers builds "
                "its own way")
    if "auto_map" in config:
        return f"{directory / CONFIG_FILE} names custom tokenizer code (auto_map)"
    if config.get("fix_mistral_regex"):
        return f"{directory / CONFIG_FILE} sets fix_mistral_regex, which transformers applies to the backend itself"
    if "fast_tokenizer_files" in config:
        return f"{directory / CONFIG_FILE} names versioned tokenizer files (fast_tokenizer_files)"
    if (directory / "tekken.json").is_file():
        return f"{directory} has a tekken.json, which transformers may load with mistral-common"
    model_type = _model_type(directory)
    if model_type in FORCED_CLASS_MODEL_TYPES:
        return f"model_type {model_type!r}: transformers loads its tokenizer with a class of its own"
    return None


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in `directory`; a one-line ValueError naming the file when one is missing or damaged,
    or when `supports(directory)` gives a reason."""
    reason = supports(directory)
    if reason is not None:
        raise ValueError(f"refusion's tokenizer cannot load {directory} as transformers does: {reason}")
    path = Path(directory) / TOKENIZER_FILE
    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # a damaged or foreign file: one line naming it, not the parser's traceback
        raise ValueError(f"could not load {path}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from None
    return Tokenizer(backend, read_init_kwargs(directory))


def read_init_kwargs(directory: str | os.PathLike) -> dict[str, Any]:
    """What transformers' `_from_pretrained` passes a `TokenizersBackend` for `directory`: tokenizer_config.json
    with the chat templates, the special tokens as strings or AddedTokens, `added_tokens_decoder`."""
    name_or_path, directory = str(directory), Path(directory)  # the name as given, as transformers keeps it
    init_kwargs = _read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
    for key in ("tokenizer_class", "init_inputs", "add_bos_token", "add_eos_token"):
        init_kwargs.pop(key, None)  # the bos/eos flags are ignored when there is a tokenizer.json
    # 1. chat templates: the .jinja files take priority over the config's
    templates = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for path in (directory / CHAT_TEMPLATE_DIR).glob("*.jinja"):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        init_kwargs["chat_template"] = templates["default"]
    elif templates:
        init_kwargs["chat_template"] = templates
    # 2. special tokens: additional_special_tokens is the old name; custom *_token keys are model-specific tokens
    if "additional_special_tokens" in init_kwargs and not init_kwargs.get("extra_special_tokens"):
        init_kwargs["extra_special_tokens"] = init_kwargs.pop("additional_special_tokens")
    model_specific = {key: init_kwargs.pop(key) for key in list(init_kwargs)
                      if key not in NAMED_SPECIAL_TOKENS and key.endswith("_token")
                      and isinstance(init_kwargs[key], str)}
    if isinstance(init_kwargs.get("extra_special_tokens"), dict):
        model_specific.update(init_kwargs.pop("extra_special_tokens"))
    if model_specific:
        init_kwargs["model_specific_special_tokens"] = model_specific
    from huggingface_hub.constants import is_offline_mode  # (light: the hub's settings, no client)

    # transformers records offline mode (HF_HUB_OFFLINE) as local_files_only, which `save_pretrained` writes
    init_kwargs.update(name_or_path=name_or_path, is_local=True, local_files_only=is_offline_mode())
    # 3. added tokens: the config's, else (older directories) the legacy files and tokenizer.json's
    added_tokens_decoder, added_tokens_map = _added_tokens(directory, init_kwargs)
    init_kwargs["added_tokens_decoder"] = added_tokens_decoder
    init_kwargs = _convert_added_tokens(init_kwargs)
    for key in NAMED_SPECIAL_TOKENS:
        if key in init_kwargs and added_tokens_map and init_kwargs[key] is not None:
            init_kwargs[key] = added_tokens_map.get(str(init_kwargs[key]), init_kwargs[key])
    return init_kwargs


def _added_tokens(directory: Path, init_kwargs: dict) -> tuple[dict[int, AddedToken], dict[str, AddedToken]]:
    """({id: AddedToken}, {content: AddedToken}) as transformers reads them; merges special_tokens_map.json into
    `init_kwargs` when the config has no `added_tokens_decoder` (a directory older than transformers 4.34)."""
    decoder: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in init_kwargs:
        for index, token in init_kwargs["added_tokens_decoder"].items():
            decoder[int(index)] = AddedToken(**token) if isinstance(token, dict) else token
        return decoder, {str(token): token for token in decoder.values()}
    if (directory / SPECIAL_TOKENS_MAP_FILE).is_file():
        for key, value in _read_json(directory / SPECIAL_TOKENS_MAP_FILE).items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value.pop("special", None)
                value = AddedToken(**value, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                existing = list(init_kwargs.get("extra_special_tokens") or [])
                for token in value:
                    token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                    if token not in existing:
                        existing.append(token)
                value = existing
            init_kwargs[key] = value
        if isinstance(init_kwargs.get("extra_special_tokens"), dict):
            named = init_kwargs.pop("extra_special_tokens")
            init_kwargs.setdefault("model_specific_special_tokens", {}).update(named)
    token_map: dict[str, AddedToken] = {}
    if (directory / ADDED_TOKENS_FILE).is_file():
        special = {str(init_kwargs[k]) for k in NAMED_SPECIAL_TOKENS if init_kwargs.get(k)}
        special |= {str(t) for t in (init_kwargs.get("extra_special_tokens") or [])}
        for content, index in _read_json(directory / ADDED_TOKENS_FILE).items():
            is_special = content in special
            decoder[index] = AddedToken(content, rstrip=False, lstrip=False, normalized=not is_special,
                                        special=is_special)
            token_map[content] = decoder[index]
    for serialized in _read_json(directory / TOKENIZER_FILE).get("added_tokens", []):
        index = serialized.pop("id")
        decoder[index] = AddedToken(**serialized)
        token_map[str(decoder[index])] = decoder[index]
    return decoder, token_map


def _convert_added_tokens(obj, *, save: bool = False):
    """transformers' `convert_added_tokens`: {"__type": "AddedToken", ...} dicts to AddedTokens (reading), or back
    (saving), anywhere in a config."""
    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        fields = {k: v for k, v in obj.items() if k != "__type"}
        return AddedToken(**fields)
    if isinstance(obj, AddedToken) and save:
        return obj.__getstate__() | {"__type": "AddedToken"}
    if isinstance(obj, (list, tuple)):
        return [_convert_added_tokens(o, save=save) for o in obj]
    if isinstance(obj, dict):
        return {k: _convert_added_tokens(v, save=save) for k, v in obj.items()}
    return obj


def _read_json(path: Path) -> dict:
    """A JSON object from `path`; a one-line ValueError naming it when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {path}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"could not read {path}: it holds a {type(data).__name__}, not a JSON object")
    return data


def _model_type(directory: Path) -> str | None:
    """config.json's model_type, when there is a readable one."""
    try:
        return json.loads((directory / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


# 2. build -----------------------------------------------------------------------------------------------------

class BatchEncoding(dict):
    """What calling the tokenizer returns: {"input_ids": ..., "attention_mask": ...}, keys also as attributes
    (`.input_ids`), like transformers' BatchEncoding."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _NamedToken:
    """A named special token (`eos_token`, a string or None) or its id (`eos_token_id`), read and set as
    transformers does: setting an id stores the token it names."""

    def __init__(self, *, as_id: bool = False):
        self.as_id = as_id

    def __set_name__(self, owner, name: str) -> None:
        self.key = name.removesuffix("_id")

    def __get__(self, tokenizer, owner=None):
        if tokenizer is None:
            return self
        return tokenizer._special_token(self.key, as_id=self.as_id)

    def __set__(self, tokenizer, value) -> None:
        tokenizer._set_special_token(self.key, value, as_id=self.as_id)


class Tokenizer:
    """A `tokenizers.Tokenizer` with the special tokens, chat template and settings of its model directory; the part
    of transformers' tokenizer API that refusion uses, with transformers' results (`load_tokenizer` builds one)."""

    bos_token, eos_token, unk_token = _NamedToken(), _NamedToken(), _NamedToken()
    sep_token, pad_token, cls_token, mask_token = _NamedToken(), _NamedToken(), _NamedToken(), _NamedToken()
    bos_token_id, eos_token_id = _NamedToken(as_id=True), _NamedToken(as_id=True)
    unk_token_id, sep_token_id = _NamedToken(as_id=True), _NamedToken(as_id=True)
    pad_token_id, cls_token_id = _NamedToken(as_id=True), _NamedToken(as_id=True)
    mask_token_id = _NamedToken(as_id=True)
    is_fast = True

    def __init__(self, backend: Backend, init_kwargs: dict[str, Any]):
        """`backend` as read from tokenizer.json (it is changed in place); `init_kwargs` from `read_init_kwargs`.
        The steps of transformers' `TokenizersBackend.__init__` and `PreTrainedTokenizerBase.__init__`."""
        kwargs = dict(init_kwargs)
        # 1. the backend's truncation and padding: their settings become defaults; a call never uses them
        if backend.truncation is not None:
            truncation = backend.truncation
            for key, value in (("max_length", truncation["max_length"]), ("truncation_side", truncation["direction"]),
                               ("stride", truncation["stride"]), ("truncation_strategy", truncation["strategy"])):
                kwargs.setdefault(key, value)
        if backend.padding is not None:
            padding = backend.padding
            for key, value in (("pad_token", padding["pad_token"]), ("pad_token_type_id", padding["pad_type_id"]),
                               ("padding_side", padding["direction"]), ("max_length", padding["length"]),
                               ("pad_to_multiple_of", padding["pad_to_multiple_of"])):
                kwargs.setdefault(key, value)
        backend.no_truncation()
        backend.no_padding()
        kwargs.setdefault("backend", "tokenizers")
        update_post_processor = backend.post_processor is None
        # 2. settings and special tokens (PreTrainedTokenizerBase.__init__)
        if "additional_special_tokens" in kwargs and "extra_special_tokens" not in kwargs:
            kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
        self.init_kwargs = copy.deepcopy(kwargs)
        self._tokenizer = backend
        self._read_settings(kwargs)
        # 3. the config's added tokens, then the special tokens the backend lacks, added in transformers' order
        self._add_missing_tokens(kwargs.get("added_tokens_decoder") or {})
        if update_post_processor:  # transformers' update_post_processor with add_bos_token = add_eos_token = False
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

    def _read_settings(self, kwargs: dict) -> None:
        self.name_or_path = kwargs.pop("name_or_path", "")
        self._processor_class = kwargs.pop("processor_class", None)
        self.verbose = kwargs.pop("verbose", False)
        self._special_names = list(NAMED_SPECIAL_TOKENS)
        self._special_tokens_map: dict[str, str | AddedToken | None] = dict.fromkeys(NAMED_SPECIAL_TOKENS)
        self._extra_special_tokens: list[str | AddedToken] = []
        explicit = kwargs.pop("model_specific_special_tokens", None) or {}
        found = {}
        for key in list(kwargs):
            if key in NAMED_SPECIAL_TOKENS:
                value = kwargs.pop(key)
                if value is not None and not isinstance(value, (str, AddedToken)):
                    raise TypeError(f"special token {key} has to be a str or AddedToken, not {type(value).__name__}")
                if value is not None:
                    self._special_tokens_map[key] = value
            elif key == "extra_special_tokens":
                value = kwargs.pop(key)
                if isinstance(value, dict):
                    self._set_model_specific_tokens(value)
                elif isinstance(value, (list, tuple)):
                    self._extra_special_tokens = list(value)
                elif value is not None:
                    raise TypeError("extra_special_tokens must be a list of tokens or a dict of named tokens")
            elif key.endswith("_token") and isinstance(kwargs[key], (str, AddedToken)):
                found[key] = kwargs.pop(key)
        max_length = kwargs.pop("model_max_length", kwargs.pop("max_len", None))
        self.model_max_length = max_length if max_length is not None else VERY_LARGE_INTEGER
        self.padding_side = kwargs.pop("padding_side", "right")
        self.truncation_side = kwargs.pop("truncation_side", "right")
        self.model_input_names = list(kwargs.pop("model_input_names", ["input_ids", "attention_mask"]))
        self.clean_up_tokenization_spaces = kwargs.pop("clean_up_tokenization_spaces", False)
        self.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = kwargs.pop(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        self.split_special_tokens = kwargs.pop("split_special_tokens", False)
        chat_template = kwargs.pop("chat_template", None)
        if isinstance(chat_template, (list, tuple)):  # the legacy list of {"name", "template"}
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self.chat_template = chat_template
        self.response_template = kwargs.pop("response_template", None)
        self.chat_control_tokens = kwargs.pop("chat_control_tokens", None)
        if {**found, **explicit}:
            self._set_model_specific_tokens({**found, **explicit})
        self.backend = kwargs.pop("backend", None)
        self.add_prefix_space = kwargs.get("add_prefix_space", False)
        self._tokenizer.encode_special_tokens = self.split_special_tokens

    def _set_model_specific_tokens(self, tokens: dict) -> None:
        """Named tokens beyond the standard ones (e.g. `image_token`): special tokens, template variables."""
        self._special_names += list(tokens)
        for key, value in tokens.items():
            if not isinstance(value, (str, AddedToken)):
                raise TypeError(f"special token {key} has to be a str or AddedToken, not {type(value).__name__}")
            self._special_tokens_map[key] = value

    def _add_missing_tokens(self, added_tokens_decoder: dict[int, AddedToken]) -> None:
        """Re-add the config's added tokens (the backend keeps or updates them), then every special token the
        backend does not hold as an added token, as transformers' `TokenizersBackend.__init__` does."""
        to_add = [token for _, token in sorted(added_tokens_decoder.items(), key=lambda item: item[0])]
        encoder = list(self.added_tokens_encoder) + [str(token) for token in to_add]
        for token in [*self._special_tokens_map.values(), *self._extra_special_tokens]:
            if token is not None and str(token) not in encoder and token not in to_add:
                to_add.append(token)
        named = [str(t) for t in self._special_tokens_map.values() if t]
        tokens = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            tokens.append(token)
        if tokens:
            self._tokenizer.add_tokens(tokens)

    # special tokens ---------------------------------------------------------------------------------------------

    def _special_token(self, key: str, *, as_id: bool):
        value = self._special_tokens_map.get(key)
        if value is None:
            return None
        return self.convert_tokens_to_ids(str(value)) if as_id else str(value)

    def _set_special_token(self, key: str, value, *, as_id: bool) -> None:
        if as_id and value is not None:
            value = self.convert_ids_to_tokens(value)
        if value is not None and not isinstance(value, (str, AddedToken)):
            raise ValueError(f"cannot set a non-string value as the {key}")
        self._special_tokens_map[key] = value

    def __getattr__(self, name: str):
        """Model-specific named tokens (`image_token`, `image_token_id`), as transformers exposes them."""
        key = name.removesuffix("_id")
        if key in self.__dict__.get("_special_names", ()) and key not in NAMED_SPECIAL_TOKENS:
            return self._special_token(key, as_id=key != name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name}")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """{name: token} of the named special tokens that are set (what chat templates see as variables)."""
        return {name: str(self._special_tokens_map[name]) for name in self._special_names
                if self._special_tokens_map.get(name) is not None}

    @property
    def extra_special_tokens(self) -> list[str]:
        """The special tokens without a name (`additional_special_tokens` before transformers 5)."""
        return [str(token) for token in self._extra_special_tokens]

    @extra_special_tokens.setter
    def extra_special_tokens(self, tokens) -> None:
        self._extra_special_tokens = [] if tokens is None else list(tokens)

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, each once."""
        named = [self._special_tokens_map.get(name) for name in self._special_names]
        tokens = [str(t) for t in named if t is not None] + self.extra_special_tokens
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """{id: AddedToken} of the backend's added tokens (`.special` says which are special)."""
        return self._tokenizer.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: i for i, token in sorted(self.added_tokens_decoder.items(), key=lambda item: item[0])}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    def add_special_tokens(self, special_tokens_dict: dict, replace_extra_special_tokens: bool = True) -> int:
        """Set named special tokens and extend (or, with `replace_extra_special_tokens`, replace) the extra ones;
        tokens the vocabulary lacks are added to it. Returns the number of tokens added."""
        if not special_tokens_dict:
            return 0
        special_tokens_dict = dict(special_tokens_dict)
        if "additional_special_tokens" in special_tokens_dict and not special_tokens_dict.get("extra_special_tokens"):
            special_tokens_dict["extra_special_tokens"] = special_tokens_dict.pop("additional_special_tokens")
        allowed = set(self._special_names) | {"extra_special_tokens"}
        tokens_to_add = []
        for key, value in special_tokens_dict.items():
            if key not in allowed:
                raise ValueError(f"key {key} is not a valid special token; valid keys are: {sorted(allowed)}")
            if key == "extra_special_tokens":
                if not isinstance(value, (list, tuple)) or not all(isinstance(t, (str, AddedToken)) for t in value):
                    raise ValueError(f"tokens {value} for key {key} should all be str or AddedToken instances")
                new_tokens = [_special(t) for t in value
                              if replace_extra_special_tokens or str(t) not in self.extra_special_tokens]
                if replace_extra_special_tokens and new_tokens:
                    self._extra_special_tokens = list(new_tokens)
                else:
                    self._extra_special_tokens.extend(new_tokens)
                tokens_to_add.extend(new_tokens)
            else:
                if not isinstance(value, (str, AddedToken)):
                    raise ValueError(f"token {value} for key {key} should be a str or an AddedToken instance")
                value = _special(value)
                self._special_tokens_map[key] = value
                tokens_to_add.append(value)
        return self.add_tokens(tokens_to_add, special_tokens=True)

    def add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        """Add tokens the vocabulary lacks (at its end); returns how many were added."""
        if not new_tokens:
            return 0
        if not isinstance(new_tokens, (list, tuple)):
            new_tokens = [new_tokens]
        if special_tokens:
            return self._tokenizer.add_special_tokens(list(new_tokens))
        return self._tokenizer.add_tokens(list(new_tokens))

    # vocabulary -------------------------------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Backend:
        """The `tokenizers.Tokenizer` underneath (e.g. for llguidance: `backend_tokenizer.to_str()`)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without the added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Each token's id; a token outside the vocabulary gets the unknown token's id (None without one)."""
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(token) for token in tokens]

    def _token_to_id(self, token: str) -> int | None:
        index = self._tokenizer.token_to_id(token)
        if index is None:
            unk = self._special_tokens_map.get("unk_token")
            return None if unk is None else self._tokenizer.token_to_id(str(unk))
        return index

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        """Each id's token (None for an id outside the vocabulary)."""
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # 3. use: encode and decode --------------------------------------------------------------------------------

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, *,
               split_special_tokens: bool | None = None, **unsupported) -> list[int]:
        """The ids of `text` (and `text_pair`), with the post-processor's special tokens when `add_special_tokens`."""
        _refuse(unsupported, "encode")
        inputs = [(text, text_pair) if text_pair else text]
        return self._encode(inputs, add_special_tokens, split_special_tokens)[0].ids

    def __call__(self, text: str | list[str], text_pair: str | list[str] | None = None, *,
                 add_special_tokens: bool = True, split_special_tokens: bool | None = None,
                 return_attention_mask: bool | None = None, return_token_type_ids: bool | None = None,
                 **unsupported) -> BatchEncoding:
        """{"input_ids", "attention_mask"} (the keys of `model_input_names`) of a string, or of each string of a
        list (then each value holds a list per string)."""
        _refuse(unsupported, "__call__")
        if not isinstance(text, (str, list, tuple)):
            raise ValueError("text input must be a str (one text) or a list of str (a batch)")
        batched = not isinstance(text, str)
        if batched:
            if isinstance(text_pair, str) or (text_pair is not None and len(text) != len(text_pair)):
                raise ValueError("a batch of texts needs a list of as many text pairs")
            inputs = list(zip(text, text_pair)) if text_pair is not None else list(text)
        else:
            inputs = [(text, text_pair)] if text_pair else [text]
        encodings = self._encode(inputs, add_special_tokens, split_special_tokens)
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        out = {"input_ids": [e.ids for e in encodings]}
        if return_token_type_ids:
            out["token_type_ids"] = [e.type_ids for e in encodings]
        if return_attention_mask:
            out["attention_mask"] = [e.attention_mask for e in encodings]
        return BatchEncoding(out if batched else {key: value[0] for key, value in out.items()})

    def _encode(self, inputs: list, add_special_tokens: bool, split_special_tokens: bool | None):
        if split_special_tokens is None:
            split_special_tokens = self.split_special_tokens
        if self._tokenizer.encode_special_tokens != split_special_tokens:
            self._tokenizer.encode_special_tokens = split_special_tokens
        return self._tokenizer.encode_batch(inputs, add_special_tokens=add_special_tokens)

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **unsupported) -> str | list[str]:
        """The text of `token_ids` (a list of lists: the text of each). `clean_up_tokenization_spaces` (default: the
        config's, else False) joins spaces before punctuation, but never for a BPE model (transformers 5)."""
        _refuse(unsupported, "decode")
        token_ids = _as_python(token_ids)
        if isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        if isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self._decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in token_ids]
        return self._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces)

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        sequences = _as_python(sequences)
        if len(sequences) == 0:
            return []
        result = self.decode(sequences, skip_special_tokens, clean_up_tokenization_spaces)
        return [result] if isinstance(result, str) else result

    def _decode(self, token_ids, skip_special_tokens: bool, clean_up: bool | None) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        clean_up = self.clean_up_tokenization_spaces if clean_up is None else clean_up
        bpe = type(self._tokenizer.model).__name__ == "BPE"
        if clean_up and (not bpe or self.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output):
            text = clean_up_tokenization(text)
        return text

    # 3. use: chat templates -----------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: `chat_template` (a template, or a name among several), else the tokenizer's."""
        if isinstance(self.chat_template, dict):
            templates = self.chat_template
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("this model has several chat templates and none is the default: pass the name of "
                                 f"one as chat_template=... (one of {sorted(templates)})")
        elif chat_template is None:
            if self.chat_template is None:
                raise ValueError("cannot use chat template functions: tokenizer.chat_template is not set and no "
                                 "template was passed")
            return self.chat_template
        return chat_template

    def apply_chat_template(self, conversation, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            sanitize_control_tokens: bool = False, padding: bool = False, truncation: bool = False,
                            max_length: int | None = None, return_tensors: str | None = None,
                            return_dict: bool = True, return_assistant_tokens_mask: bool = False,
                            tokenizer_kwargs: dict | None = None, **kwargs):
        """The conversation rendered by the chat template (`tokenize=False`: the text), else tokenized without
        added special tokens: a BatchEncoding by default, the ids with `return_dict=False`. A list of
        conversations gives a list of each. `kwargs` are further template variables."""
        _refuse({"sanitize_control_tokens": sanitize_control_tokens, "padding": padding, "truncation": truncation,
                 "max_length": max_length, "return_tensors": return_tensors,
                 "return_assistant_tokens_mask": return_assistant_tokens_mask}, "apply_chat_template")
        if not tokenize:
            return_dict = False
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
        conversations = [_normalize_messages(c) for c in (conversation if batched else [conversation])]
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible: use "
                             "continue_final_message to continue the final message, add_generation_prompt to open "
                             "a new assistant message")
        rendered = render_chat_template(template, conversations, tools=tools, documents=documents,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        **{**self.special_tokens_map, **kwargs})
        if not batched:
            rendered = rendered[0]
        if not tokenize:
            return rendered
        out = self(rendered, add_special_tokens=False, **(tokenizer_kwargs or {}))
        return out if return_dict else out["input_ids"]

    # 4. save ------------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike) -> tuple[str, ...]:
        """Write tokenizer_config.json, chat_template.jinja (additional_chat_templates/*.jinja for more) and
        tokenizer.json as transformers' `save_pretrained` does; returns the files written."""
        directory = Path(save_directory)
        if directory.is_file():
            raise ValueError(f"{directory} should be a directory, not a file")
        directory.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(self.init_kwargs)
        for key in ("add_bos_token", "add_eos_token"):
            config.pop(key, None)
        for key in (set(self.init_kwargs) - {"add_bos_token", "add_eos_token"}) | {"model_max_length"}:
            found, value = self._saved_value(key)
            if found:
                config[key] = value
        config.update(self.special_tokens_map)
        if self._extra_special_tokens:
            config["extra_special_tokens"] = self.extra_special_tokens
        written = self._save_chat_templates(directory, config)
        if self.response_template is not None:
            config["response_template"] = self.response_template
        if self.chat_control_tokens is not None:
            config["chat_control_tokens"] = list(self.chat_control_tokens)
        config = _convert_added_tokens(config, save=True)
        for key in ("tokenizer_file", "vocab_file", "added_tokens_decoder", "additional_special_tokens",
                    "files_loaded", "device_map", "slow_tokenizer_class"):
            config.pop(key, None)
        config["tokenizer_class"] = "TokenizersBackend"
        if self._processor_class is not None:
            config["processor_class"] = self._processor_class
        if "name_or_path" in config:
            for key in ("name_or_path", "special_tokens_map_file"):
                config.pop(key, None)
        config_file = directory / CONFIG_FILE
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                               encoding="utf-8")
        tokenizer_file = directory / TOKENIZER_FILE
        self._tokenizer.save(str(tokenizer_file))
        return (str(config_file), *written, str(tokenizer_file))

    def _saved_value(self, key: str) -> tuple[bool, Any]:
        """(whether transformers' tokenizer has an attribute `key`, its value): what save_pretrained writes for a
        config key."""
        if key in _SAVED_ATTRIBUTES:
            return True, getattr(self, key)
        if key == "pad_token_type_id":
            return True, 0
        if key == "added_tokens_decoder":
            return True, self.added_tokens_decoder
        if key == "extra_special_tokens":
            return True, self.extra_special_tokens
        name = key.removesuffix("_ids").removesuffix("_id") if key.endswith(("_id", "_ids")) else key
        if name in self._special_names:
            return True, self._special_token(name, as_id=name != key)
        return False, None

    def _save_chat_templates(self, directory: Path, config: dict) -> list[str]:
        written = []
        if isinstance(self.chat_template, str):
            (directory / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
            written.append(str(directory / CHAT_TEMPLATE_FILE))
        elif isinstance(self.chat_template, dict):
            for name, template in self.chat_template.items():
                if name == "default":
                    path = directory / CHAT_TEMPLATE_FILE
                else:
                    (directory / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
                    path = directory / CHAT_TEMPLATE_DIR / f"{name}.jinja"
                    if path.resolve().parent != (directory / CHAT_TEMPLATE_DIR).resolve():
                        raise ValueError(f"invalid chat template name: {name!r}")
                path.write_text(template, encoding="utf-8")
                written.append(str(path))
        else:
            return written
        config.pop("chat_template", None)
        return written

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"len={len(self)}, special_tokens={self.special_tokens_map})")


def _special(token: str | AddedToken) -> AddedToken:
    """A special token as `add_special_tokens` adds it: a string becomes an unnormalized special AddedToken."""
    if isinstance(token, str):
        return AddedToken(token, rstrip=False, lstrip=False, normalized=False, special=True)
    return token


def _refuse(arguments: dict, method: str) -> None:
    """A clear error for the options of transformers' method that refusion's tokenizer leaves out (padding,
    truncation, tensors...), when one is given a value that would change the result."""
    given = [name for name, value in arguments.items() if value not in (None, False, "do_not_pad", "do_not_truncate")]
    if given:
        raise TypeError(f"refusion's Tokenizer.{method} does not take {', '.join(given)}: load the tokenizer with "
                        "transformers for that")


def _as_python(ids):
    """Ids as Python ints and lists (a tensor or an array via tolist), without importing torch or numpy."""
    if hasattr(ids, "tolist"):
        return ids.tolist()
    if isinstance(ids, list) and all(type(i) is int for i in ids):  # a stream's ids each step: nothing to convert
        return ids
    if isinstance(ids, (list, tuple)):
        return [_as_python(i) for i in ids]
    if isinstance(ids, dict):
        return {k: _as_python(v) for k, v in ids.items()}
    return ids


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: the spaces a WordPiece decode leaves before punctuation removed."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# chat templates, rendered as transformers renders them (transformers/utils/chat_template_utils.py) --------------

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning is passed under; templates read the first (gpt-oss templates read `thinking`)."""
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(template: str, conversations: list[list[dict]], /, *, tools: list | None = None,
                         documents: list | None = None, add_generation_prompt: bool = False,
                         continue_final_message: bool | str = False, **variables) -> list[str]:
    """Each conversation rendered by `template` in transformers' sandbox, with its variables and the final message
    left open when `continue_final_message` (True: its "content"; a string: that field)."""
    compiled = _compile(template)
    if tools is not None:
        tools = [tool if isinstance(tool, dict) else _tool_schema(tool) for tool in tools]
    for document in documents or []:
        if not isinstance(document, dict):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools, documents, variables = _plain(tools), _plain(documents), _plain(variables)
    rendered = []
    for chat in conversations:
        chat = _plain(getattr(chat, "messages", chat))
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError("Chat messages should be dicts, dataclasses or pydantic models, but got "
                                f"{message!r}.")
        chat = _alias_reasoning_fields(chat)
        if continue_final_message:
            continue_final_message, final_message = _tag_final_message(chat, template, continue_final_message)
        text = compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            text = _cut_after_final_message(text, final_message)
        rendered.append(text)
    return rendered


def _tag_final_message(chat: list[dict], template: str, field: bool | str) -> tuple[str, str]:
    """Append the continue tag to the final message's `field` (True: "content"); (field name, its text)."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    field = field if isinstance(field, str) else "content"
    final_message = chat[-1].get(field)
    if final_message is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning is copied under several names: tag each copy the template may read
        fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final_message]
    if not any(name in template for name in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final_message, (list, tuple)):
        for block in reversed(final_message):
            if "text" in block:
                final_message = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but we could not find any text to continue in the "
                             "final message!")
    else:
        for name in fields:
            chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    return field, final_message


def _cut_after_final_message(text: str, final_message: str) -> str:
    if final_message.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template! This can happen if the chat template deletes portions of the "
                         "final message. Please verify the chat template and final message in your chat to ensure "
                         f"they are compatible.Final message to continue: {final_message.strip()}\n"
                         f"Rendered chat:\n{text}")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def _tool_schema(tool) -> dict:
    """A callable tool's JSON schema, by transformers (its docstring parser is imported only for this)."""
    import inspect

    if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
        raise ValueError("Tools should either be a JSON schema, or a callable function with type hints and a "
                         "docstring suitable for auto-conversion to a schema.")
    from transformers.utils.chat_template_utils import get_json_schema

    return get_json_schema(tool)


def _normalize_messages(conversation) -> list[dict]:
    """Message objects (dataclasses, pydantic models) as dicts, without the keys whose value is None."""
    messages = _messages_as_dicts(getattr(conversation, "messages", conversation))
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def _messages_as_dicts(value):
    if isinstance(value, Mapping):
        return {key: _messages_as_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_messages_as_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_messages_as_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _messages_as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _messages_as_dicts(value.model_dump())
    return value


def _plain(value):
    """What a template may see: JSON types only, anything else an inert "<TypeName>" (transformers'
    `_plain_template_data`; the sandbox does not know which methods of rich objects are dangerous)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if any(c.__name__ == "generic" and c.__module__ == "numpy" for c in type(value).__mro__):
        return _plain(value.item())  # a numpy scalar, recognised without importing numpy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list) -> list:
    aliased = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


@functools.lru_cache
def _compile(template: str):
    """`template` compiled in transformers' environment: an immutable sandbox with trim_blocks and lstrip_blocks,
    loop controls, a `{% generation %}` tag, and its `tojson`, `raise_exception`, `strftime_now`, `dict` and
    `namespace`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env.from_string(template)


def _generation_tag():
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks where it lies, for assistant
    token masks; rendering is the same)."""
    import jinja2.nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: no HTML escaping, and indent / separators / sort_keys options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` in templates, without the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.cache
def _namespace_class():
    """jinja2's Namespace refusing underscore-prefixed attributes (no way into CPython internals)."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace
