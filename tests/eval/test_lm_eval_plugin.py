"""The lm-eval model `refusion`: registered by name, generate_until through ReFusion, AR log-likelihoods."""

import json
import subprocess
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from refusion.eval.lm_eval_plugin import ReFusionLM, cut_at_stop  # noqa: E402

ROWS = [{"question": "what is 1+1?", "answer": "2", "choices": ["2", "3"], "label": 0},
        {"question": "what is 2+3?", "answer": "5", "choices": ["4", "5"], "label": 1},
        {"question": "name a colour.", "answer": "red", "choices": ["red", "seven"], "label": 0}]

GEN_TASK = """task: refusion_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

MC_TASK = """task: refusion_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm-eval-tasks")
    data = path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (path / "gen.yaml").write_text(GEN_TASK.format(data=data))
    (path / "mc.yaml").write_text(MC_TASK.format(data=data))
    return path


@pytest.fixture(scope="module")
def lm(tiny):
    model, tokenizer = tiny
    return ReFusionLM(model=model, tokenizer=tokenizer, slot_size=4, block_size=8, max_new_tokens=16, batch_size=2)


def test_registered_by_name():
    from lm_eval.api.registry import get_model
    assert get_model("refusion") is ReFusionLM


def test_simple_evaluate_on_tiny_tasks(lm, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager
    out = lm_eval.simple_evaluate(model=lm, tasks=["refusion_tiny_gen", "refusion_tiny_mc"],
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), log_samples=True)
    assert out["results"]["refusion_tiny_gen"]["sample_len"] == 3
    samples = out["samples"]["refusion_tiny_mc"]
    right = [max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) == s["doc"]["label"] for s in samples]
    assert out["results"]["refusion_tiny_mc"]["acc,none"] == pytest.approx(sum(right) / len(ROWS))
    responses = [s["resps"][0][0] for s in out["samples"]["refusion_tiny_gen"]]
    assert all(isinstance(r, str) and "\n\n" not in r for r in responses)
    loglikelihoods = [s["resps"] for s in out["samples"]["refusion_tiny_mc"]]
    assert all(ll[0][0] < 0 for doc in loglikelihoods for ll in doc)


def test_speculative_strategy_as_a_model_arg(tiny, task_dir, monkeypatch):
    """`strategy=speculative` from a model_args string: generate_until answers exactly what AR decoding does."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    model, tokenizer = tiny
    extra = {"model": model, "tokenizer": tokenizer, "batch_size": 2}
    responses = {}
    for strategy in ("speculative", "autoregressive"):
        lm = ReFusionLM.create_from_arg_string(f"strategy={strategy},draft_length=2,max_new_tokens=12", extra)
        assert (lm.decode_config.strategy, lm.decode_config.draft_length) == (strategy, 2)
        out = lm_eval.simple_evaluate(model=lm, tasks=["refusion_tiny_gen"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
        responses[strategy] = [s["resps"][0][0] for s in out["samples"]["refusion_tiny_gen"]]
    assert responses["speculative"] == responses["autoregressive"] and len(responses["speculative"]) == 3


@pytest.mark.parametrize("favoured, accuracy", [({"2", "4", "red"}, 2 / 3), ({"3", "5", "seven"}, 1 / 3)])
def test_multiple_choice_accuracy_equals_a_hand_computed_value(tiny, task_dir, monkeypatch, favoured, accuracy):
    """A scripted scorer prefers the `favoured` answers: ROWS' labels make the accuracy known by hand, so a
    request routed to the wrong document or choice (batching, reordering) changes it."""
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, tokenizer = tiny
    lm = ReFusionLM(model=model, tokenizer=tokenizer, slot_size=4, block_size=8, max_new_tokens=16, batch_size=2)
    seen = []

    def scripted(pairs):
        texts = [tokenizer.decode(cont).strip() for _, cont in pairs]
        seen.extend(texts)
        return [(0.0 if t in favoured else -10.0, False) for t in texts]

    monkeypatch.setattr(lm, "_score_batch", scripted)
    out = lm_eval.simple_evaluate(model=lm, tasks=["refusion_tiny_mc"],
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    assert sorted(seen) == sorted(c for row in ROWS for c in row["choices"])  # every choice scored once
    assert out["results"]["refusion_tiny_mc"]["acc,none"] == pytest.approx(accuracy)


def test_loglikelihood_matches_a_plain_forward(lm):
    model = lm.model
    pairs = [([3, 10, 11, 12], [13, 14]), ([3, 20], [21, 22, 23, 24, 25])]  # different lengths: padding
    scored = lm._score_batch(pairs)
    for (ctx, cont), (ll, greedy) in zip(pairs, scored, strict=True):
        ids = torch.tensor([ctx + cont])
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
        expected = sum(logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
        assert ll == pytest.approx(expected, abs=1e-4)
        argmax = logprobs[len(ctx) - 1:-1].argmax(-1).tolist()
        assert greedy == (argmax == cont)


def test_greedy_continuation_is_flagged(lm):
    model = lm.model
    ctx = [3, 10, 11]
    with torch.no_grad():
        nxt = model(torch.tensor([ctx])).logits[0, -1].argmax().item()
    assert lm._score_batch([(ctx, [nxt])])[0][1] is True


def test_cut_at_stop():
    assert cut_at_stop("a\n\nb</s>c", ["</s>", "\n\n"]) == "a"
    assert cut_at_stop("abc", []) == "abc"


def test_unknown_model_arg(tiny):
    with pytest.raises(ValueError, match="unknown refusion model_args"):
        ReFusionLM(model=tiny[0], tokenizer=tiny[1], slotsize=4)


@pytest.mark.slow
def test_lm_eval_command_line(tiny_dir, task_dir, tmp_path):
    """`python -m refusion.eval.lm_eval_plugin` = lm_eval's CLI with the model registered (lm-eval <= 0.4.13)."""
    args = ["--model", "refusion", "--model_args", f"pretrained={tiny_dir},slot_size=4,block_size=8",
            "--tasks", "refusion_tiny_gen", "--include_path", str(task_dir), "--limit", "2",
            "--output_path", str(tmp_path / "out")]
    r = subprocess.run([sys.executable, "-m", "refusion.eval.lm_eval_plugin", *args], capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "HF_DATASETS_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refusion_tiny_gen" in r.stdout and "exact_match" in r.stdout
