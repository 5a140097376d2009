"""Training data: file formats, chat template, EOS, length filter, built-in splits, clear errors."""

from __future__ import annotations

import gzip
import json

import pytest

from refusion.model.tiny import TINY_EOS_ID, tiny_tokenizer
from refusion.train.data import (
    default_data_dir,
    load_conversations,
    load_training_data,
    response_eos_id,
    tokenize_conversations,
)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_json_list_and_messages_records(tmp_path):
    jsonl = _write(tmp_path / "a.jsonl", [json.dumps({"query": "q1", "response": "r1"}), "",
                                          json.dumps({"query": "q2", "response": "r2"})])
    listed = tmp_path / "b.json"
    listed.write_text(json.dumps([{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "r"}]}]))
    a, b = load_conversations(str(jsonl)), load_conversations(str(listed))
    assert [c.response for c in a] == ["r1", "r2"] and a[1].origin.endswith("a.jsonl:3")
    assert b[0].messages == ({"role": "system", "content": "s"}, {"role": "user", "content": "q"})
    assert b[0].response == "r"


def test_gzip_compressed_jsonl(tmp_path):
    path = tmp_path / "distilled.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"query": "q1", "response": "r1", "origin": "gsm8k/train.jsonl:1"}) + "\n")
    (conversation,) = load_conversations(str(path))
    assert conversation.response == "r1" and conversation.origin.endswith("distilled.jsonl.gz:1")


@pytest.mark.parametrize("line, message", [
    ('{"query": "q"}', r"bad\.jsonl:2: expected a record"),
    ('{"query": "q", "response": 3}', r"bad\.jsonl:2: expected a record"),
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "r"}]}',
     r"bad\.jsonl:2: the last message must have role \"assistant\""),
    ('{"messages": "hello"}', r"bad\.jsonl:2: \"messages\" must be a list"),
])
def test_malformed_record_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"query": "q", "response": "r"}), line])
    with pytest.raises(ValueError, match=message):
        load_conversations(str(path))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"query": "caf\u00e9", "response": "r"}, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl is not UTF-8 text"):
        load_conversations(str(path))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no records"):
        load_conversations(str(tmp_path / "empty.jsonl"))


def test_chat_template_prompt_and_eos_response(tmp_path):
    tokenizer = tiny_tokenizer()
    assert response_eos_id(tokenizer) == TINY_EOS_ID
    path = _write(tmp_path / "a.jsonl", [json.dumps({"query": "1+1?", "response": "2"})])
    data = tokenize_conversations(load_conversations(str(path)), tokenizer, eos_id=TINY_EOS_ID, max_length=100)
    expected_prompt = tokenizer("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False).input_ids
    assert data.prompts[0].tolist() == expected_prompt
    assert data.responses[0].tolist() == [*tokenizer("2", add_special_tokens=False).input_ids, TINY_EOS_ID]


def test_eos_follows_the_chat_template_not_the_tokenizer_eos():
    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = "<|im_start|>"  # like the SmolLM2 GGUF, whose reported EOS is <|im_start|>
    assert response_eos_id(tokenizer) == TINY_EOS_ID
    assert response_eos_id(tokenizer, "<|im_start|>") == 3
    with pytest.raises(ValueError, match="not in the tokenizer"):
        response_eos_id(tokenizer, "<|nope|>")


def test_long_samples_are_skipped_and_counted(tmp_path):
    path = _write(tmp_path / "a.jsonl", [json.dumps({"query": "q", "response": "r" * n}) for n in (1, 50, 2, 80)])
    data = load_training_data((str(path),), tiny_tokenizer(), eos_id=TINY_EOS_ID, max_length=40)
    assert len(data) == 2 and data.skipped_too_long == 2
    with pytest.raises(ValueError, match="longer than max_length=5"):
        load_training_data((str(path),), tiny_tokenizer(), eos_id=TINY_EOS_ID, max_length=5)


def test_missing_builtin_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="built-in data set 'gsm8k' needs .*--data-dir"):
        load_conversations("gsm8k", data_dir=tmp_path)


@pytest.mark.skipif(not (default_data_dir() / "gsm8k").is_dir(), reason="shared data folder absent")
@pytest.mark.parametrize("name, rows", [("gsm8k", 7473), ("mbpp", 374), ("math", 7500)])
def test_builtin_train_splits(name, rows):
    conversations = load_conversations(name)
    assert len(conversations) == rows
    first = conversations[0]
    assert first.messages[0]["role"] == "user" and first.response
    if name == "gsm8k":
        assert "<<" not in first.response and first.response.endswith("The final answer is $\\boxed{72}$.")
    if name in ("gsm8k", "math"):  # the prompt format `refusion eval` uses for the same task
        from refusion.eval.tasks import BOXED_INSTRUCTION
        assert first.messages[0]["content"].endswith(BOXED_INSTRUCTION)
    if name == "mbpp":
        assert "Your code should pass these tests" in first.messages[0]["content"]
        assert first.response.startswith("```python\n")
