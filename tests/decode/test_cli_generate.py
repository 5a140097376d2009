"""`refusion generate` end to end on a tiny saved model, and its one-line errors."""

import io
import json
import subprocess
import sys

import pytest

from refusion.cli import main


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def test_generate_json_and_stats(model_dir, capsys):
    assert main(["generate", "what is 2+2?", "--model", model_dir, "--max-new-tokens", "12", "--slot-size", "4",
                 "--block-size", "8", "--dtype", "float32", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt"] == "what is 2+2?" and 1 <= record["stats"]["tokens"] <= 12
    assert record["config"]["slot_size"] == 4 and len(record["token_ids"]) == record["stats"]["tokens"]

    assert main(["generate", "hi", "bye", "--model", model_dir, "--max-new-tokens", "6", "--stats",
                 "--strategy", "autoregressive", "--no-chat"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens/forward 1.00") == 2 and "--- [1] bye" in out


def test_generate_json_carries_logprobs(model_dir, capsys):
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "6", "--strategy", "autoregressive",
                 "--dtype", "float32", "--logprobs", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [lp["token"] for lp in record["logprobs"]] == record["token_ids"]
    assert all(len(lp["top"]) == 2 and lp["top"][0][0] == lp["token"] for lp in record["logprobs"])


def test_generate_json_schema_constrains_the_answer(model_dir, tmp_path, capsys):
    pytest.importorskip("llguidance")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"enum": ["yes", "no"]}))
    for strategy in ("autoregressive", "speculative"):
        assert main(["generate", "is it?", "--model", model_dir, "--max-new-tokens", "12", "--strategy", strategy,
                     "--dtype", "float32", "--json-schema", str(schema), "--json"]) == 0
        assert json.loads(json.loads(capsys.readouterr().out)["text"]) in ("yes", "no")
    assert main(["generate", "is it?", "--model", model_dir, "--json-schema", str(schema)]) != 0
    assert "strategy 'refusion'" in capsys.readouterr().err


def test_preset_then_flags_override(model_dir, capsys):
    assert main(["generate", "x", "--model", model_dir, "--preset", "demo", "--max-new-tokens", "8",
                 "--slot-size", "2", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["slot_size"], config["block_size"], config["slot_threshold"]) == (2, 16, 0.6)


@pytest.mark.parametrize("argv,words", [
    (["--slot-size", "3", "--block-size", "4"], "block_size=4 is invalid"),
    (["--slot-threshold", "2"], "slot_threshold=2.0 is invalid"),
    (["--strategy", "beam"], "strategy='beam' is invalid"),
    (["--model", "/nonexistent/dir"], "does not exist"),
])
def test_bad_flags_print_one_line_and_exit_2(model_dir, capsys, argv, words):
    argv = ["generate", "hello"] + (argv if "--model" in argv else argv + ["--model", model_dir])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


BAD_BYTES = b"\xff\xfe".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv


@pytest.mark.parametrize("argv,words", [
    (["hello", "--device", "tpu"], "--device=tpu is not a device"),
    (["hello", "--device", "cuda:x"], "--device=cuda:x is not a device"),
    ([BAD_BYTES], "the prompt is not UTF-8 text"),
    (["hello", "--system", BAD_BYTES], "--system is not UTF-8 text"),
    (["hello", "--strategy", "autoregressive", "--json-schema", "{dir}/missing.json"], "missing.json: No such file"),
    (["hello", "--strategy", "autoregressive", "--json-schema", "{dir}/latin1.json"], "latin1.json is not UTF-8"),
    (["hello", "--strategy", "autoregressive", "--json-schema", "{dir}/broken.json"],
     "broken.json: not valid JSON (line 1, column 2"),
    (["--input", "{dir}", "--output", "{dir}/out.jsonl"], ": Is a directory"),
    (["--input", "{dir}/latin1.json", "--output", "{dir}/out.jsonl"], "latin1.json is not UTF-8 text"),
    (["--input", "{dir}/prompts.jsonl", "--output", "{dir}"], "is a directory: give a JSONL file"),
    (["--input", "{dir}/prompts.jsonl", "--output", "{dir}/missing/out.jsonl"], "out.jsonl: No such file"),
])
def test_bad_devices_paths_and_encodings_print_one_line(model_dir, tmp_path, capsys, argv, words):
    (tmp_path / "latin1.json").write_bytes("{\"caf\u00e9\": 1}".encode("latin-1"))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "ok"}\n')
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert main(["generate", "--model", model_dir, "--max-new-tokens", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("refusion generate: error: ") and words in err, err


def test_an_unavailable_device_is_one_line_on_every_command_that_takes_one(model_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for argv in (["generate", "hello"], ["chat"], ["calibrate"], ["eval", "--task", "gsm8k", "--limit", "1"],
                 ["serve", "--port", "0"]):
        assert main([*argv, "--model", model_dir, "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"refusion {argv[0]}: error: --device=cuda is not available on this machine") \
            and "\n" not in err, err


def test_empty_prompt_is_refused(model_dir, capsys):
    assert main(["generate", "  ", "--model", model_dir]) == 2
    assert "empty prompt" in capsys.readouterr().err


def test_python_m_refusion_help():
    out = subprocess.run([sys.executable, "-m", "refusion", "generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--max-new-tokens", "--slot-size", "--block-size", "--slot-threshold", "--token-threshold",
                 "--temperature", "--seed", "--strategy", "--no-chat", "--stats", "--json"):
        assert flag in out.stdout


def test_generate_from_file_writes_training_records_and_continues(model_dir, tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(5)) + "\n")
    target = tmp_path / "answers.jsonl"
    argv = ["generate", "--model", model_dir, "--input", str(source), "--output", str(target),
            "--batch-size", "2", "--max-new-tokens", "6", "--strategy", "autoregressive"]
    assert main(argv) == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["query"] for r in records] == [f"question {i}" for i in range(5)]
    assert all(isinstance(r["response"], str) and r["stats"]["tokens"] <= 6 for r in records)
    # an interrupted run continues where it stopped; nothing already written is lost or repeated
    target.write_text("\n".join(target.read_text().splitlines()[:3]) + "\n")
    assert main(argv) == 0
    again = [json.loads(line) for line in target.read_text().splitlines()]
    texts = [(r["query"], r["response"]) for r in records]
    assert [(r["query"], r["response"]) for r in again] == texts  # greedy: the regenerated tail is identical


def test_generate_from_a_bad_file_names_the_line(model_dir, tmp_path, capsys):
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    assert main(["generate", "--model", model_dir, "--input", str(source), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert f"{source}:2" in capsys.readouterr().err


def test_generate_from_a_builtin_split_uses_the_eval_prompt_format(model_dir, tmp_path, monkeypatch, capsys,
                                                                   sample_data_dir):
    from refusion.eval.tasks import BOXED_INSTRUCTION

    monkeypatch.setenv("REFUSION_DATA_DIR", str(sample_data_dir))  # GSM8K's first train rows
    monkeypatch.chdir(tmp_path)  # "gsm8k" is not a file here: it names the built-in train split
    target = tmp_path / "distill.jsonl"
    argv = ["generate", "--model", model_dir, "--input", "gsm8k", "--limit", "3", "--output", str(target),
            "--batch-size", "3", "--max-new-tokens", "4", "--strategy", "autoregressive"]
    assert main(argv) == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 3
    assert records[0]["query"].startswith("Natalia sold clips") and records[0]["query"].endswith(BOXED_INSTRUCTION)
    assert main([*argv, "--limit", "0"]) == 2
    assert "--limit=0" in capsys.readouterr().err


def test_stdin_that_is_not_utf8_is_a_one_line_error(model_dir, capsys, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)  # as a shell pipe arrives under a C / POSIX locale
    assert main(["generate", "--model", model_dir, "-"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stdin is not UTF-8" in err and "0xff" in err


def test_generate_from_file_seeds_each_record_by_its_index(model_dir, tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": "same question"}) for _ in range(4)) + "\n")
    responses = {}
    for batch_size in (2, 4):
        target = tmp_path / f"sampled-{batch_size}.jsonl"
        assert main(["generate", "--model", model_dir, "--input", str(source), "--output", str(target),
                     "--batch-size", str(batch_size), "--max-new-tokens", "8", "--strategy", "autoregressive",
                     "--temperature", "1.0", "--seed", "3", "--dtype", "float32"]) == 0
        responses[batch_size] = [json.loads(line)["response"] for line in target.read_text().splitlines()]
    assert responses[2] == responses[4]  # record i is sampled with seed + i, whatever its batch
    assert len(set(responses[4])) > 1  # and the records are not copies of each other


def test_stats_line_says_where_the_forwards_went(model_dir, capsys):
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "8", "--stats", "--strategy",
                 "speculative", "--draft-length", "2", "--no-chat"]) == 0
    stats = capsys.readouterr().out.strip().splitlines()[-1]
    assert stats.startswith("[speculative | tokens ") and "(prefill 1, verify " in stats and "drafts accepted" in stats
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "8", "--stats", "--slot-size", "2",
                 "--block-size", "4", "--no-chat"]) == 0
    stats = capsys.readouterr().out.strip().splitlines()[-1]
    assert stats.startswith("[refusion | tokens ") and "(plan " in stats


def test_generate_from_file_batches_continuously_and_writes_in_input_order(model_dir, tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": "word " * (1 + 3 * (i % 4)) + str(i)}) for i in range(7)) + "\n")
    responses = {}
    for batch_size in (1, 3):  # with 3, newcomers join while older prompts are still decoding
        target = tmp_path / f"greedy-{batch_size}.jsonl"
        assert main(["generate", "--model", model_dir, "--input", str(source), "--output", str(target),
                     "--batch-size", str(batch_size), "--max-new-tokens", "10", "--strategy", "autoregressive",
                     "--dtype", "float32"]) == 0
        records = [json.loads(line) for line in target.read_text().splitlines()]
        assert [r["query"] for r in records] == [json.loads(line)["prompt"] for line in source.read_text().splitlines()]
        responses[batch_size] = [r["response"] for r in records]
    assert responses[3] == responses[1]


def test_skip_leaves_out_the_first_prompts_and_an_output_file_is_an_input(model_dir, tmp_path, capsys):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"count to {i}"}) + "\n" for i in range(5)))
    full, tail = tmp_path / "full.jsonl", tmp_path / "tail.jsonl"
    common = ["--model", model_dir, "--max-new-tokens", "6", "--strategy", "autoregressive", "--dtype", "float32"]
    assert main(["generate", "--input", str(source), "--output", str(full), *common]) == 0
    assert main(["generate", "--input", str(source), "--skip", "2", "--limit", "4", "--output", str(tail),
                 *common]) == 0
    records = [json.loads(line) for line in full.read_text().splitlines()]
    answered = [(r["query"], r["response"], r["origin"]) for r in records]
    assert [(r["query"], r["response"], r["origin"]) for r in map(json.loads, tail.read_text().splitlines())] \
        == answered[2:4]
    again = tmp_path / "again.jsonl"  # a generate output as --input keeps each record's origin
    assert main(["generate", "--input", str(full), "--output", str(again), *common]) == 0
    assert [json.loads(line)["origin"] for line in again.read_text().splitlines()] == [r["origin"] for r in records]
    capsys.readouterr()
    assert main(["generate", "--input", str(source), "--skip", "4", "--limit", "4", "--output", str(tmp_path / "x"),
                 *common]) == 2
    assert "--skip=4 is invalid" in capsys.readouterr().err
