"""Fixtures for the evaluation tests: the data folders, a tiny model, and a scripted tokenizer."""

from __future__ import annotations

import pytest

from refusion.eval.tasks import default_data_dir


@pytest.fixture(scope="session")
def data_dir(sample_data_dir):
    """The first rows of each task's data file (tests/fixtures/data): enough for every test but those about whole
    data sets."""
    return sample_data_dir


@pytest.fixture(scope="session")
def shared_data_dir():
    """The whole data sets (the data folder beside the project, or $REFUSION_DATA_DIR); skipped without it."""
    path = default_data_dir()
    if not (path / "gsm8k" / "test.jsonl").is_file():
        pytest.skip(f"the whole data sets are not at {path} (set REFUSION_DATA_DIR to a folder holding them)")
    return path


@pytest.fixture(scope="session")
def tiny():
    from refusion.model.tiny import tiny_model, tiny_tokenizer
    return tiny_model(), tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny):
    """The tiny model and tokenizer saved as a transformers directory (for --model / pretrained=)."""
    path = tmp_path_factory.mktemp("tiny-model")
    model, tokenizer = tiny
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class ByteTokenizer:
    """Bytes as token ids (EOS 0), with a chat template that is just the user text: enough for the runner."""

    chat_template = "{{ messages[-1]['content'] }}"
    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return list(messages[-1]["content"].encode())

    def __call__(self, text):
        return {"input_ids": list(text.encode())}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i != 0).decode(errors="replace")


@pytest.fixture
def byte_tokenizer():
    return ByteTokenizer()
