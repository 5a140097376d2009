"""The trace file: round trip, engine -> trace, and clear errors for bad or truncated files."""

import json

import pytest

from refusion.viz.schema import FORMAT, VERSION, load_trace, save_trace


def test_round_trip(tmp_path, trace_doc, ar_doc, speculative_doc):
    for doc in (trace_doc, ar_doc, speculative_doc):
        path = save_trace(doc, tmp_path / "t.json")
        data = json.loads(path.read_text())
        assert (data["format"], data["version"]) == (FORMAT, VERSION)
        assert load_trace(path) == doc
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left


def test_version_1_files_still_read(tmp_path, trace_doc):
    """Version 1 had no per-round accounting: those fields read as empty / false / 0."""
    data = trace_doc.to_dict()
    data["version"] = 1
    for seq in data["sequences"]:
        for rnd in seq["rounds"]:
            for name in ("phase_forwards", "fused_plan", "drafted", "accepted"):
                del rnd[name]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    doc = load_trace(path)
    assert doc.version == 1
    rnd = doc.sequences[0].rounds[2]
    assert (rnd.phase_forwards, rnd.fused_plan, rnd.drafted, rnd.accepted) == ({}, False, 0, 0)
    assert [r.committed for r in doc.sequences[0].rounds] == [r.committed for r in trace_doc.sequences[0].rounds]


def _corrupt(data: dict, how: str):
    if how == "format":
        data["format"] = "something-else"
    elif how == "version":
        data["version"] = VERSION + 1
    elif how == "how":
        data["sequences"][0]["rounds"][1]["how"] = "magic"
    elif how == "start":
        data["sequences"][0]["rounds"][0]["committed"][0]["start"] = "5"
    elif how == "outside":
        data["sequences"][0]["rounds"][0]["committed"][0]["start"] = 99
    elif how == "texts":
        data["sequences"][1]["rounds"][0]["planned"][0]["texts"].pop()
    elif how == "missing":
        del data["sequences"][0]["rounds"]
    elif how == "empty":
        data["sequences"] = []
    elif how == "phase":
        data["sequences"][0]["rounds"][1]["phase_forwards"] = {"guess": 1}
    elif how == "accepted":
        data["sequences"][0]["rounds"][0]["accepted"] = 2
    return data


@pytest.mark.parametrize("how,words", [
    ("format", "not a refusion trace"),
    ("version", f"version {VERSION + 1} is newer"),
    ("how", "sequences[0].rounds[1].how is 'magic'"),
    ("start", "sequences[0].rounds[0].committed[0].start must be an integer"),
    ("outside", "outside the response canvas"),
    ("texts", "sequences[1].rounds[0].planned[0].texts must be one string per token"),
    ("missing", "sequences[0].rounds is missing"),
    ("empty", "sequences is empty"),
    ("phase", "sequences[0].rounds[1].phase_forwards['guess'] must be a count"),
    ("accepted", "sequences[0].rounds[0]: accepted 2 drafts of 0"),
])
def test_bad_fields_are_named(tmp_path, trace_doc, how, words):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_corrupt(trace_doc.to_dict(), how)))
    with pytest.raises(ValueError, match="t.json") as e:
        load_trace(path)
    assert words in str(e.value)


def test_truncated_empty_and_missing_files(tmp_path, trace_doc):
    path = save_trace(trace_doc, tmp_path / "t.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="is truncated"):
        load_trace(path)
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_trace(path)
    path.write_text("{nope}")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_trace(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace(tmp_path / "absent.json")


def test_build_trace_from_the_engine():
    import refusion
    from refusion.decode.outputs import SlotEvent
    from refusion.model.tiny import tiny_model, tiny_tokenizer
    from refusion.viz.schema import build_trace, trace_from_dict

    model, tokenizer = tiny_model(), tiny_tokenizer()
    prompts = ["hi", "2+2="]
    ids = refusion.encode_prompts(tokenizer, prompts, chat=False)
    for strategy in ("refusion", "speculative", "autoregressive"):
        cfg = refusion.DecodeConfig(max_new_tokens=8, slot_size=4, block_size=8, slot_threshold=0.5,
                                    token_threshold=0.3, strategy=strategy)
        out = refusion.generate(model, ids, cfg, trace=True)
        doc = build_trace(out, tokenizer, prompts, ids, cfg, model="tiny")
        assert trace_from_dict(json.loads(json.dumps(doc.to_dict()))) == doc  # valid by its own rules
        for seq, tokens, rounds in zip(doc.sequences, out.sequences, out.traces, strict=True):
            assert seq.prompt_length == len(ids[seq.index]) and seq.response_ids == tokens
            assert len(seq.rounds) == len(rounds) == seq.stats["rounds"]
            committed = [t for r in seq.rounds for s in r.committed for t in s.texts]
            assert "".join(sorted(committed)) == "".join(sorted(tokenizer.decode([t]) for t in tokens))
        for seq, stats in zip(doc.sequences, out.stats.per_sequence, strict=True):
            assert sum(r.forwards for r in seq.rounds) == stats.forwards  # every forward is in some round
            totals = {}
            for r in seq.rounds:
                assert sum(r.phase_forwards.values()) == r.forwards
                for phase, n in r.phase_forwards.items():
                    totals[phase] = totals.get(phase, 0) + n
            assert {k: v for k, v in totals.items() if v} == {k: v for k, v in stats.phase_forwards.items() if v}
            assert sum(r.drafted for r in seq.rounds) == stats.drafted
        if strategy == "autoregressive":
            assert all(r.how == "autoregressive" and len(r.committed[0].tokens) == 1 for r in doc.sequences[0].rounds)
        if strategy == "speculative":
            assert all(r.how == "speculative" for r in doc.sequences[0].rounds)
            assert out.sequences == refusion.generate(model, ids, cfg.replace(strategy="autoregressive")).sequences
    assert isinstance(out.traces[0][0].committed[0], SlotEvent)
