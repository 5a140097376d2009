"""The trace file: round trip, engine -> trace, and clear errors for bad or truncated files."""

import json

import pytest

from refusion.viz.schema import FORMAT, VERSION, load_trace, save_trace


def test_round_trip(tmp_path, trace_doc, ar_doc):
    for doc in (trace_doc, ar_doc):
        path = save_trace(doc, tmp_path / "t.json")
        data = json.loads(path.read_text())
        assert (data["format"], data["version"]) == (FORMAT, VERSION)
        assert load_trace(path) == doc
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left


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
    for strategy in ("refusion", "autoregressive"):
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
        if strategy == "autoregressive":
            assert all(r.how == "autoregressive" and len(r.committed[0].tokens) == 1 for r in doc.sequences[0].rounds)
    assert isinstance(out.traces[0][0].committed[0], SlotEvent)
