"""The draft table: n-gram statistics of a model's own answers, verified like copied drafts (never changing the
output), saved beside the weights, built by `refusion draft-table`."""

import json

import pytest
import torch

import refusion
from refusion.model.draft_table import DEFAULT_ORDERS, TABLE_FILE, DraftTable, RunIndex
from refusion.model.setup import prepare, setup_of
from refusion.model.tiny import tiny_model, tiny_tokenizer


def test_the_table_keeps_each_frequent_run_s_most_frequent_follower():
    table = DraftTable.from_sequences([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [7, 8, 9, 4]], orders=(3,),
                                      min_count=2)
    assert table.followers == {(1, 2, 3): (4, 2 / 3)}  # (2, 3, 4) etc. were seen once: left out
    assert DraftTable.from_sequences([[7, 8, 9, 4]], orders=(3,), min_count=1).followers == {(7, 8, 9): (4, 1.0)}
    # several orders: runs of each length, counted separately
    table = DraftTable.from_sequences([[1, 2, 3], [1, 2, 3], [5, 2, 4]], orders=(2, 1), min_count=2)
    assert table.orders == (2, 1)
    assert table.followers == {(1, 2): (3, 1.0), (1,): (2, 1.0), (2,): (3, 2 / 3)}
    with pytest.raises(ValueError, match="min_confidence"):
        DraftTable.from_sequences([], min_confidence=0)
    with pytest.raises(ValueError, match="orders"):
        DraftTable.from_sequences([], orders=(3, 0))


def test_runs_that_say_what_their_shorter_run_says_are_left_out_and_the_drafts_stay_the_same():
    import collections
    import random

    rng = random.Random(0)
    sequences = [[rng.choice([1, 2, 3, 4, 5, 6]) for _ in range(rng.randint(5, 40))] for _ in range(60)]
    sequences += [[7, 8, 9, 10, 11, 12]] * 3  # long runs always followed by the same token
    orders = (5, 4, 3, 2, 1)
    counts = collections.defaultdict(collections.Counter)  # every frequent run, counted here
    for ids in sequences:
        for order in orders:
            for i in range(len(ids) - order):
                counts[tuple(ids[i: i + order])][ids[i + order]] += 1
    full = {run: (after.most_common(1)[0][0], after.most_common(1)[0][1] / sum(after.values()))
            for run, after in counts.items() if sum(after.values()) >= 2}
    table = DraftTable.from_sequences(sequences, orders, min_count=2, min_confidence=0.05)
    assert table.followers.items() <= full.items() and len(table.followers) < len(full)
    assert (7, 8, 9, 10) not in table.followers and (10,) in table.followers  # (9, 10) etc. say (11, 1.0) too
    reference = DraftTable(orders, 0.05, full)
    texts = [ids[:end] for ids in sequences for end in range(1, len(ids) + 1)]
    assert all(table.drafts(text, 8) == reference.drafts(text, 8) for text in texts)
    assert sum(bool(table.drafts(text, 8)) for text in texts) > len(texts) // 2  # drafts were compared


def test_the_table_keeps_each_run_s_runner_up_and_reads_it_from_the_run_its_chain_starts_from():
    table = DraftTable.from_sequences([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 4]], orders=(3, 2),
                                      min_count=2)
    assert table.followers == {(1, 2, 3): (4, 2 / 3), (2, 3): (4, 3 / 4), (1, 2): (3, 1.0)}
    assert table.runner_ups == {(1, 2, 3): 5, (2, 3): 5}  # each run's second most frequent follower, where it had one
    assert table.runner_up([7, 1, 2, 3]) == 5 and table.runner_up([8, 2, 3]) == 5  # the run `drafts` reads
    assert table.runner_up([1, 2]) is None  # no run
    alone = DraftTable.from_sequences([[1, 2, 3], [1, 2, 3]], orders=(2,), min_count=2)
    assert alone.runner_ups == {} and alone.runner_up([1, 2]) is None  # one follower only: no runner-up


def test_drafts_walk_the_table_while_confident():
    table = DraftTable((2,), 0.3, {(1, 2): (3, 0.9), (2, 3): (4, 0.5), (3, 4): (5, 0.5), (4, 5): (6, 1.0)})
    assert table.drafts([9, 1, 2], 8) == [3, 4]  # 0.9 * 0.5 = 0.45 >= 0.3; * 0.5 = 0.225 < 0.3: stop
    assert table.drafts([9, 1, 2], 1) == [3]  # at most `length`
    assert table.drafts([3, 4], 8) == [5, 6]  # 0.5, then 0.5 * 1.0
    assert table.drafts([2, 1], 8) == [] and table.drafts([2], 8) == []  # unknown run; too short a text


def test_each_step_reads_the_longest_run_the_table_knows():
    table = DraftTable((3, 1), 0.1, {(1, 2, 3): (4, 0.5), (3,): (7, 0.9), (4,): (5, 0.8), (5,): (6, 0.6),
                                     (3, 4, 5): (9, 0.5)})
    # after [1, 2, 3] the run of 3 wins over (3,); after [2, 3, 4] only (4,) is known; after [3, 4, 5] the run of 3
    assert table.drafts([1, 2, 3], 8) == [4, 5, 9]  # confidence 0.5, 0.5 * 0.8 = 0.4, 0.4 * 0.5 = 0.2; (9,): none
    assert table.drafts([8, 3], 2) == [7]  # (8, 3) is no run of 3 tokens: the run of 1 drafts
    assert table.drafts([3], 1) == [7]  # a text shorter than the longest order


@pytest.mark.parametrize("largest_id", [65535, 65536, 151935])  # 16-bit ids up to 65535, 32-bit above
def test_a_table_saves_loads_and_a_damaged_file_is_a_one_line_error(tmp_path, largest_id):
    from safetensors import safe_open

    a, b = largest_id, largest_id - 1
    table = DraftTable.from_sequences([[1, a, 3, 4, 1, a, 3, 4], [b, 1, a, 3, 6]], orders=(3, 2), min_count=2,
                                      min_confidence=0.25)
    table.save(tmp_path / TABLE_FILE)
    loaded = DraftTable.load(tmp_path / TABLE_FILE)
    assert (loaded.orders, loaded.min_confidence) == ((3, 2), 0.25)
    assert loaded.followers.keys() == table.followers.keys() and table.followers
    for run, (token, frequency) in table.followers.items():  # frequencies are stored in fp32
        assert loaded.followers[run] == (token, pytest.approx(frequency, rel=1e-6))
    assert loaded.runner_ups == table.runner_ups == {(a, 3): 6}  # (1, a, 3) says what (a, 3) says: left out
    with safe_open(str(tmp_path / TABLE_FILE), "pt") as f:
        assert f.get_tensor("runs_3").dtype == (torch.uint16 if largest_id <= 65535 else torch.int32)
    saved = (tmp_path / TABLE_FILE).read_bytes()
    loaded.save(tmp_path / TABLE_FILE)  # the same table saved again: the same bytes (a rebuilt table diffs clean)
    assert (tmp_path / TABLE_FILE).read_bytes() == saved
    (tmp_path / TABLE_FILE).write_bytes(b"not a table")
    with pytest.raises(ValueError, match="is not a draft table"):
        DraftTable.load(tmp_path / TABLE_FILE)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_table_drafts_never_change_the_output_and_are_accepted_when_they_are_the_model_s(arch):
    model = tiny_model(arch)
    prompts = [[1, 5, 7, 9], [12, 13, 14, 15, 16], [9]]
    cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=1, eos_token_id=2)
    ar = refusion.generate(model, prompts, cfg.replace(strategy="autoregressive")).sequences
    # the table of the model's own answers: its drafts are what AR decoding writes wherever the runs are unique
    table = DraftTable.from_sequences([p[-3:] + s for p, s in zip(prompts, ar)], orders=(3,), min_count=1,
                                      min_confidence=0.5)
    setup = setup_of(model).replace(draft_table=table)
    without = refusion.generate(model, prompts, cfg, setup=setup)
    with_table = refusion.generate(model, prompts, cfg.replace(table_length=4), trace=True, setup=setup)
    assert with_table.sequences == without.sequences == ar
    assert with_table.stats.batch.forwards < without.stats.batch.forwards
    longest = max(len(e.tokens) for rounds in with_table.traces for r in rounds for e in r.planned)
    assert longest > 1  # only table drafts run longer than the one mask's


def runner_up_table(prompts: list[list[int]], answers: list[list[int]], vocab_size: int) -> DraftTable:
    """A table of runs of 2 whose every follower is wrong for these answers and whose runner-up is right (where a
    run occurs twice, its first occurrence decides)."""
    followers, runner_ups = {}, {}
    for prompt, answer in zip(prompts, answers):
        text = prompt + answer
        for i in range(len(prompt), len(text) - 1):
            run = tuple(text[i - 1: i + 1])
            if run not in followers:
                followers[run], runner_ups[run] = ((text[i + 1] + 1) % vocab_size, 0.9), text[i + 1]
    return DraftTable((2,), 0.5, followers, runner_ups)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_runner_up_chain_is_committed_where_it_is_the_model_s_and_the_output_stays_ar_s(arch):
    """A table whose every follower is wrong and whose runner-ups are what AR decoding writes: each round of a
    sequence decoded alone commits the next token and the runner-up (from the second chain); a batch verifies one
    chain a round (until one sequence is left); the output is AR's either way."""
    model = tiny_model(arch)
    prompts = [[1, 5, 7, 9], [12, 13, 14, 15, 16]]
    cfg = refusion.DecodeConfig(max_new_tokens=24, strategy="speculative", draft_length=0, table_length=4,
                                eos_token_id=2)
    ar = refusion.generate(model, prompts, cfg.replace(strategy="autoregressive")).sequences
    table = runner_up_table(prompts, ar, model.config.vocab_size)
    setup = setup_of(model).replace(draft_table=table)
    without = refusion.generate(model, prompts, cfg,
                                setup=setup.replace(draft_table=DraftTable((2,), 0.5, table.followers)))
    alone = [refusion.generate(model, [p], cfg, setup=setup, trace=True) for p in prompts]
    batch = refusion.generate(model, prompts, cfg, setup=setup)
    assert [out.sequences[0] for out in alone] == batch.sequences == without.sequences == ar
    rounds = [r for out in alone for r in out.traces[0]]
    assert sum(len(r.committed[0].tokens) == 2 and len(r.planned) == 2 for r in rounds) > len(rounds) // 2
    assert sum(out.stats.batch.forwards for out in alone) < sum(s.forwards for s in without.stats.per_sequence)


def test_table_drafts_at_temperature_keep_the_output_reproducible_and_exact_in_greedy_limit():
    model = tiny_model("qwen3", dtype=torch.float64)
    prompts = [[1, 5, 7, 9], [12, 13, 14, 15, 16]]
    cfg = refusion.DecodeConfig(max_new_tokens=16, strategy="speculative", temperature=2.0, seed=3, eos_token_id=[])
    setup = setup_of(model).replace(draft_table=DraftTable.from_sequences([[5, 7, 9, 1, 2, 3, 4]], min_count=1))
    sampled = refusion.generate(model, prompts, cfg.replace(table_length=3), setup=setup).sequences
    assert refusion.generate(model, prompts, cfg.replace(table_length=3), setup=setup).sequences == sampled
    assert refusion.generate(model, prompts[:1], cfg.replace(table_length=3), setup=setup).sequences == sampled[:1]


def test_draft_table_command_builds_the_table_that_load_attaches(tmp_path):
    from refusion.cli import main

    model, tokenizer = tiny_model(), tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    records = [{"query": "hello", "response": "hello world hello world"}] * 3
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert setup_of(refusion.load(tmp_path / "m", dtype="float32", device="cpu")[0]).draft_table is None
    assert main(["draft-table", str(tmp_path / "answers.jsonl"), "--model", str(tmp_path / "m"),
                 "--output", str(tmp_path / "m")]) == 0
    loaded, _ = refusion.load(tmp_path / "m", dtype="float32", device="cpu")
    table = setup_of(loaded).draft_table
    ids = tokenizer("hello world hello world", add_special_tokens=False)["input_ids"]
    assert table is not None and table.drafts(ids[:3], 1) == ids[3:4]
    assert main(["draft-table", str(tmp_path / "answers.jsonl"), "--output", str(tmp_path / "nowhere")]) == 2
    assert main(["draft-table", str(tmp_path / "answers.jsonl"), "--output", str(tmp_path / "m"),
                 "--orders", "3,x"]) == 2
    assert prepare(model, directory=tmp_path).draft_table is None  # no table there: none in the setup


def test_the_shipped_table_is_what_the_recipe_builds_by_default():
    from refusion.model import embedded

    table = DraftTable.load(embedded.ADAPTER_DIR / TABLE_FILE)
    assert table.orders == DEFAULT_ORDERS  # `refusion draft-table` without --orders, as the recipe runs it
    assert {len(run) for run in table.followers} == set(DEFAULT_ORDERS)


def test_a_table_written_with_one_metadata_entry_per_setting_still_loads(tmp_path):
    """Tables saved before the settings became one JSON entry (the shipped one among them) load as they did."""
    from safetensors.torch import load_file, save_file

    table = DraftTable.from_sequences([[1, 2, 3, 4, 1, 2, 3, 5]], orders=(2, 1), min_count=1, min_confidence=0.5)
    table.save(tmp_path / "new.safetensors")
    save_file(load_file(tmp_path / "new.safetensors"), str(tmp_path / "old.safetensors"),
              metadata={"orders": "2,1", "min_confidence": "0.5"})
    old = DraftTable.load(tmp_path / "old.safetensors")
    assert (old.orders, old.min_confidence, old.followers) == (table.orders, table.min_confidence,
                                                               DraftTable.load(tmp_path / "new.safetensors").followers)


@pytest.mark.parametrize("orders,largest_id", [((3, 2), 151935), ((4, 3), 151935)])  # the second's keys need > 63 bits
def test_a_loaded_table_drafts_as_it_did_from_dicts_whether_indexed_or_not(tmp_path, orders, largest_id, monkeypatch):
    """A loaded table answers from the file's arrays (`RunIndex`) where run keys fit 63 bits, else from dicts; both
    give the same followers, runner-ups and drafts (those of the file's fp32 frequencies)."""
    import random

    rng = random.Random(0)
    words = [1, 2, 3, 4, 5, largest_id, largest_id - 7]
    sequences = [[rng.choice(words) for _ in range(60)] for _ in range(20)]
    table = DraftTable.from_sequences(sequences, orders=orders, min_count=2, min_confidence=0.05)
    table.save(tmp_path / TABLE_FILE)
    loaded = DraftTable.load(tmp_path / TABLE_FILE)
    monkeypatch.setattr(RunIndex, "of", staticmethod(lambda orders, parts: None))
    dicts = DraftTable.load(tmp_path / TABLE_FILE)
    indexed = largest_id ** max(orders) < 2**63
    assert isinstance(loaded.followers, RunIndex) == indexed and isinstance(dicts.followers, dict)
    assert dict(loaded.followers) == dicts.followers and dict(loaded.runner_ups) == dicts.runner_ups
    assert set(loaded.followers) == set(table.followers) and dict(loaded.runner_ups) == table.runner_ups
    for text in sequences[:5] + [[9, 9], [largest_id + 1, 1, 2], []]:
        for end in range(len(text) + 1):
            assert loaded.drafts(text[:end], 6) == dicts.drafts(text[:end], 6)
            assert loaded.runner_up(text[:end]) == dicts.runner_up(text[:end])
