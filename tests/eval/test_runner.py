"""The evaluation runner: scripted responses give exact accuracies; the tiny model runs both strategies."""

import json

import pytest

from refusion.decode.outputs import BatchStats, GenerationOutput, GenerationStats, SequenceStats
from refusion.eval.runner import EvalSettings, Processes, evaluate, format_table, shard
from refusion.eval.tasks import load_examples


def scripted_generate(answers: dict[str, str], tokens_per_forward: float = 2.0, seconds_per_token: float = 0.01):
    """A `generate` that answers each prompt (by its text) with a fixed response and fixed statistics."""
    calls = []

    def generate(model, prompt_ids, cfg):
        calls.append((len(prompt_ids), cfg))
        sequences, per_sequence = [], []
        for ids in prompt_ids:
            text = answers.get(bytes(ids).decode(), "no idea")
            seq = list(text.encode()) + [0]  # EOS = 0
            sequences.append(seq)
            forwards = max(1, round(len(seq) / tokens_per_forward))
            per_sequence.append(SequenceStats(len(seq), forwards, forwards, len(seq) * seconds_per_token, "eos"))
        tokens = sum(map(len, sequences))
        batch = BatchStats(tokens, max(s.forwards for s in per_sequence), tokens * seconds_per_token, 0.0)
        return GenerationOutput(sequences, GenerationStats(per_sequence, batch))

    generate.calls = calls
    return generate


def test_scripted_accuracy_and_speed(data_dir, byte_tokenizer, tmp_path):
    examples = load_examples("gsm8k", data_dir, limit=6)
    # right for examples 0, 2, 4; wrong for the others
    answers = {ex.prompt: f"\\boxed{{{ex.reference + (0 if i % 2 == 0 else 1):g}}}" for i, ex in enumerate(examples)}
    generate = scripted_generate(answers)
    settings = EvalSettings(["gsm8k"], limit=6, batch_size=4, progress=False, warmup=False, data_dir=str(data_dir))
    doc = evaluate(None, byte_tokenizer, settings, generate_fn=generate, samples_path=tmp_path / "s.jsonl")
    for strategy in ("refusion", "autoregressive"):
        m = doc["results"]["gsm8k"][strategy]
        assert (m["accuracy"], m["correct"], m["n"]) == (0.5, 3, 6)
        assert m["tokens_per_second"] == pytest.approx(100.0)  # 1 token / 0.01 s
        lengths = [len(answers[ex.prompt].encode()) + 1 for ex in examples]
        assert m["mean_generated_length"] == pytest.approx(sum(lengths) / 6)
        assert m["config"]["strategy"] == strategy
        assert m["config"]["max_new_tokens"] == 512  # gsm8k preset
        # the preset's plan-and-infill settings reach the strategy that reads them, and no other (default 8)
        assert m["config"]["slot_size"] == (32 if strategy == "refusion" else 8)
    assert [n for n, _ in generate.calls] == [4, 2, 4, 2]  # batches of 4, for each strategy
    samples = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(samples) == 12
    assert [s["correct"] for s in samples[:6]] == [True, False] * 3
    assert samples[0]["extracted"] == pytest.approx(examples[0].reference)
    assert doc["speedup"]["gsm8k"]["tokens_per_second"] == pytest.approx(1.0)
    assert "gsm8k" in format_table(doc)


def test_overrides_and_preset_reach_the_config(data_dir, byte_tokenizer):
    generate = scripted_generate({})
    settings = EvalSettings(["arc_challenge"], strategies=["refusion"], limit=1, preset="demo",
                            overrides={"slot_threshold": 0.5}, max_new_tokens=64, progress=False, warmup=False,
                            data_dir=str(data_dir))
    evaluate(None, byte_tokenizer, settings, generate_fn=generate)
    cfg = generate.calls[0][1]
    assert (cfg.slot_size, cfg.block_size, cfg.slot_threshold, cfg.max_new_tokens) == (4, 16, 0.5, 64)


def test_code_task_is_scored_by_execution(data_dir, byte_tokenizer):
    examples = load_examples("mbpp", data_dir, limit=2)
    answers = {examples[0].prompt: "```python\ndef remove_Occ(s, ch):\n    s = s.replace(ch, '', 1)\n"
                                   "    i = s.rfind(ch)\n    return s if i < 0 else s[:i] + s[i + 1:]\n```",
               examples[1].prompt: "```python\ndef sort_matrix(m):\n    return m\n```"}
    settings = EvalSettings(["mbpp"], strategies=["refusion"], limit=2, progress=False, warmup=False,
                            data_dir=str(data_dir))
    doc = evaluate(None, byte_tokenizer, settings, generate_fn=scripted_generate(answers))
    assert doc["results"]["mbpp"]["refusion"]["correct"] == 1


def test_tiny_model_both_strategies(data_dir, tiny, tmp_path):
    model, tokenizer = tiny
    settings = EvalSettings(["gsm8k", "mbpp"], limit=2, batch_size=2, max_new_tokens=8, progress=False,
                            overrides={"slot_size": 4, "block_size": 8}, data_dir=str(data_dir))
    doc = evaluate(model, tokenizer, settings, samples_path=tmp_path / "s.jsonl")
    for task in ("gsm8k", "mbpp"):
        rf, ar = doc["results"][task]["refusion"], doc["results"][task]["autoregressive"]
        assert rf["n"] == ar["n"] == 2
        assert ar["tokens_per_forward"] <= 1.0 + 1e-9  # one token per forward, at most
        assert 0 < rf["mean_generated_length"] <= 8 and rf["tokens_per_second"] > 0
        assert ar["config"]["strategy"] == "autoregressive"
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 8
    assert doc["environment"]["versions"]["torch"] and doc["environment"]["model_parameters"] > 0


def test_shard_is_a_partition():
    items = list(range(11))
    shards = [shard(items, r, 3) for r in range(3)]
    assert sorted(sum(shards, [])) == items
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        shard(items, 3, 3)
    assert Processes().gather([1, 2]) == [1, 2]


@pytest.mark.parametrize("kwargs, match", [
    ({"tasks": ["nope"]}, "unknown"), ({"tasks": []}, "no task"), ({"tasks": ["gsm8k"], "strategies": ["ar"]}, "strategy"),
    ({"tasks": ["gsm8k"], "limit": 0}, "limit"), ({"tasks": ["gsm8k"], "batch_size": 0}, "batch_size"),
    ({"tasks": ["gsm8k"], "preset": "fast"}, "preset"),
])
def test_invalid_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvalSettings(**kwargs)


def test_every_strategy_is_compared_to_the_autoregressive_baseline(data_dir, byte_tokenizer):
    def generate(model, prompt_ids, cfg):  # speculative twice as fast as AR, refusion four times
        per_token = {"autoregressive": 0.04, "speculative": 0.02, "refusion": 0.01}[cfg.strategy]
        return scripted_generate({}, seconds_per_token=per_token)(model, prompt_ids, cfg)

    settings = EvalSettings(["gsm8k"], strategies=["refusion", "speculative", "autoregressive"], limit=2,
                            progress=False, warmup=False, data_dir=str(data_dir))
    doc = evaluate(None, byte_tokenizer, settings, generate_fn=generate)
    compared = doc["speedup"]["gsm8k"]["by_strategy"]
    assert set(compared) == {"refusion", "speculative"}
    assert compared["speculative"]["tokens_per_second"] == pytest.approx(2.0)
    assert doc["speedup"]["gsm8k"]["tokens_per_second"] == pytest.approx(4.0)  # refusion's, as before
    assert "2.00x" in format_table(doc) and "4.00x" in format_table(doc)
