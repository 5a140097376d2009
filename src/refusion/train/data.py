"""Training data: records -> chat-templated (prompt, response + EOS) token ids (docs/TRAINING.md, "Data").

Accepted sources:
- a JSON list or JSONL file (.gz: gzip-compressed) of {"query": ..., "response": ...} records (the reference
  format) or {"messages": [{"role", "content"}, ...]} chat records whose last message is the assistant's response;
- the built-in prompt sets of `refusion.data` with their gold answers (train and validation splits: "gsm8k",
  "mbpp" (task ids 601-974), "math", "arc_challenge_train", "arc_challenge_dev", "mmlu_pro_validation", and
  "distill-mix", all of them interleaved), read from a data folder or the Hugging Face hub (`refusion.data_files`).

The prompt goes through the tokenizer's chat template with the generation prompt; the response is
followed by the turn-end token. Samples longer than the maximum length are skipped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from refusion.data import BUILTIN_DATASETS, builtin_train_files, builtin_train_pairs, default_data_dir
from refusion.jsonl import not_utf8, open_text, parse_lines

__all__ = ["BUILTIN_DATASETS", "Conversation", "TokenizedData", "check_sources", "default_data_dir",
           "load_conversations", "load_training_data", "response_eos_id", "tokenize_conversations"]

_SENTINEL = "zq7x9"


@dataclass(frozen=True)
class Conversation:
    """One training record: the prompt messages and the response text."""

    messages: tuple[dict, ...]
    """Prompt turns ({"role", "content"}), rendered with the chat template and the generation prompt."""
    response: str
    """Assistant response; EOS is appended after tokenization."""
    origin: str
    """"file:line" (or "dataset:row") for error messages."""


@dataclass
class TokenizedData:
    """Token ids of the samples kept for training, and how many were skipped as too long."""

    prompts: list[torch.Tensor] = field(default_factory=list)
    responses: list[torch.Tensor] = field(default_factory=list)
    skipped_too_long: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def lengths(self) -> list[int]:
        return [p.numel() + r.numel() for p, r in zip(self.prompts, self.responses, strict=True)]


# 1. where the data lives ------------------------------------------------------------------------------------

def check_sources(sources: tuple[str, ...], data_dir: str | Path | None = None) -> None:
    """Fail fast (before any model is loaded) on a --data value that is neither a file nor a built-in set."""
    for source in sources:
        if source in BUILTIN_DATASETS and not Path(source).exists():
            builtin_train_files(source, data_dir)
        elif not Path(source).is_file():
            raise FileNotFoundError(f"data file {source} does not exist (built-in data sets: "
                                    f"{', '.join(BUILTIN_DATASETS)})")


# 2. reading records -----------------------------------------------------------------------------------------

def read_json_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(origin, record) of a JSON list or JSONL file (gzip-compressed when its name ends in .gz); a line or record
    that does not parse is a ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    try:
        with open_text(path) as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        for i, record in enumerate(records):
            yield f"{path}: record {i + 1}", record
        return
    for number, record in parse_lines(text.splitlines(), path):
        yield f"{path}:{number}", record


def to_conversation(record, origin: str) -> Conversation:
    """A {"query", "response"} or {"messages": [...]} record as a Conversation (ValueError names `origin`)."""
    if isinstance(record, dict) and "messages" in record:
        return _chat_conversation(record["messages"], origin)
    if isinstance(record, dict) and isinstance(record.get("query"), str) and isinstance(record.get("response"), str):
        return Conversation(({"role": "user", "content": record["query"]},), record["response"], origin)
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{origin}: expected a record with string fields \"query\" and \"response\", or \"messages\"; "
                     f"got {keys}")


def _chat_conversation(messages, origin: str) -> Conversation:
    ok = (isinstance(messages, list) and len(messages) >= 2
          and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                  for m in messages))
    if not ok:
        raise ValueError(f"{origin}: \"messages\" must be a list of at least 2 {{\"role\", \"content\"}} strings")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{origin}: the last message must have role \"assistant\" (the response), "
                         f"got {messages[-1]['role']!r}")
    return Conversation(tuple(messages[:-1]), messages[-1]["content"], origin)


def builtin_conversations(name: str, data_dir: str | Path | None = None) -> Iterator[Conversation]:
    """A built-in prompt set, formatted as user question -> gold answer."""
    for origin, query, response in builtin_train_pairs(name, data_dir):
        yield Conversation(({"role": "user", "content": query},), response, origin)


def load_conversations(source: str, data_dir: str | Path | None = None,
                       max_samples: int | None = None) -> list[Conversation]:
    """Conversations of one --data value: a built-in name (when no such file exists) or a JSON / JSONL file."""
    if source in BUILTIN_DATASETS and not Path(source).exists():
        records = builtin_conversations(source, data_dir)
    else:
        records = (to_conversation(record, origin) for origin, record in read_json_records(source))
    out = []
    for conversation in records:
        if max_samples is not None and len(out) >= max_samples:
            break
        out.append(conversation)
    if not out:
        raise ValueError(f"data source {source!r} holds no records")
    return out


# 3. tokenization --------------------------------------------------------------------------------------------

def response_eos_id(tokenizer, eos_token: str | None = None) -> int:
    """Id of the token that ends a response: `eos_token` if given, else the special token the chat template puts
    right after an assistant turn (e.g. <|im_end|>), else the tokenizer's EOS."""
    if eos_token is not None:
        if eos_token not in tokenizer.get_vocab():
            raise ValueError(f"eos_token={eos_token!r} is not in the tokenizer's vocabulary")
        return tokenizer.convert_tokens_to_ids(eos_token)
    turn_end = _chat_turn_end_id(tokenizer)
    if turn_end is not None:
        return turn_end
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token and no chat template turn end; pass eos_token")
    return tokenizer.eos_token_id


def _chat_turn_end_id(tokenizer) -> int | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False)
    after = text.split(_SENTINEL, 1)[-1].lstrip()
    ids = tokenizer(after, add_special_tokens=False).input_ids if after else []
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    return ids[0] if ids and ids[0] in special else None


def render_prompt(tokenizer, messages: tuple[dict, ...]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; training prompts are rendered with it")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def tokenize_conversations(conversations: list[Conversation], tokenizer, *, eos_id: int, max_length: int,
                           reserved: int = 0) -> TokenizedData:
    """Chat-templated prompt ids and response ids + EOS; samples longer than max_length - reserved are skipped."""
    prompts = tokenizer([render_prompt(tokenizer, c.messages) for c in conversations],
                        add_special_tokens=False).input_ids
    responses = tokenizer([c.response for c in conversations], add_special_tokens=False).input_ids
    data = TokenizedData()
    for prompt, response in zip(prompts, responses, strict=True):
        if len(prompt) + len(response) + 1 + reserved > max_length:
            data.skipped_too_long += 1
            continue
        data.prompts.append(torch.tensor(prompt, dtype=torch.long))
        data.responses.append(torch.tensor(response + [eos_id], dtype=torch.long))
    return data


def load_training_data(sources: tuple[str, ...], tokenizer, *, eos_id: int, max_length: int, reserved: int = 0,
                       data_dir: str | Path | None = None, max_samples: int | None = None) -> TokenizedData:
    """All sources, in order, tokenized; raises ValueError when nothing fits in max_length."""
    data = TokenizedData()
    for source in sources:
        part = tokenize_conversations(load_conversations(source, data_dir, max_samples), tokenizer, eos_id=eos_id,
                                      max_length=max_length, reserved=reserved)
        data.prompts += part.prompts
        data.responses += part.responses
        data.skipped_too_long += part.skipped_too_long
    if not data.prompts:
        raise ValueError(f"all {data.skipped_too_long} samples are longer than max_length={max_length}")
    return data
