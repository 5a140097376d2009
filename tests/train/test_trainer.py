"""Training runs on a tiny model: the loss goes down, the output is a standard HF directory, LoRA,
metrics, output-directory safety, kill-and-resume equivalence, and a two-process run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refusion.train.config import TrainConfig
from refusion.train.trainer import list_checkpoints, train

SRC = Path(__file__).resolve().parents[2] / "src"


def _config(tiny_dir, data_file, output, **changes):
    values = dict(model=str(tiny_dir), data=(str(data_file),), output=str(output), batch_size=4, lr=3e-3,
                  max_length=128, save_every=0, num_workers=0, mixed_precision="no", seed=0)
    return TrainConfig(**{**values, **changes})


def _metrics(output):
    return [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss_and_writes_a_standard_model(tiny_dir, data_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = train(_config(tiny_dir, data_file, tmp_path / "out", max_steps=30))
    metrics = _metrics(tmp_path / "out")
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert {"step", "loss", "loss_ar", "loss_mdm", "lr", "epoch", "tokens"} <= set(metrics[0])
    first, last = sum(m["loss"] for m in metrics[:5]) / 5, sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert metrics[-1]["lr"] == pytest.approx(0.0, abs=1e-9)  # cosine to zero
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.mask_token_id == 63
    assert AutoTokenizer.from_pretrained(tmp_path / "out").convert_tokens_to_ids("<|mask|>") == 63
    summary = json.loads((tmp_path / "out" / "refusion_train.json").read_text())
    assert summary["finished"] and summary["steps"] == 30 and summary["ranks_in_sync"]
    assert result.num_samples == 64 and result.skipped_too_long == 0
    import refusion

    loaded, _ = refusion.load(str(tmp_path / "out"), dtype=torch.float32, device="cpu")
    assert loaded.config.mask_token_id == 63


def test_grad_accum_and_log_every(tiny_dir, data_file, tmp_path):
    train(_config(tiny_dir, data_file, tmp_path / "a", max_steps=4, grad_accum=3, log_every=2,
                  objective="ar", logits_on_labels=False, bucket_by_length=True))
    metrics = _metrics(tmp_path / "a")
    assert [m["step"] for m in metrics] == [2, 4]
    assert all(m["loss_mdm"] == 0 for m in metrics)  # the AR baseline has no masked tokens
    assert metrics[0]["epoch"] == pytest.approx(2 * 3 / 16)


def test_output_directory_is_never_clobbered(tiny_dir, data_file, tmp_path):
    out = tmp_path / "out"
    train(_config(tiny_dir, data_file, out, max_steps=2, save_every=1))
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds a trained model"):
        train(_config(tiny_dir, data_file, out, max_steps=2))
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run"):
        train(_config(tiny_dir, data_file, out, max_steps=2, overwrite=True))
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        train(_config(tiny_dir, data_file, out, max_steps=2, resume=str(tmp_path)))
    assert (out / "model.safetensors").read_bytes() == before and len(list_checkpoints(out)) == 2


class _Killed(Exception):
    pass


def test_kill_and_resume_reaches_the_same_state(tiny_dir, data_file, tmp_path):
    from safetensors.torch import load_file

    common = dict(max_steps=8, save_every=3, grad_accum=2, batch_size=2)
    train(_config(tiny_dir, data_file, tmp_path / "straight", **common))

    def kill_after_step_5(metrics):
        if metrics["step"] == 5:
            raise _Killed

    with pytest.raises(_Killed):
        train(_config(tiny_dir, data_file, tmp_path / "resumed", **common), on_step=kill_after_step_5)
    assert [p.name for p in list_checkpoints(tmp_path / "resumed")] == ["step-0000003"]
    train(_config(tiny_dir, data_file, tmp_path / "resumed", resume="latest", **common))

    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    ma, mb = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [m["step"] for m in mb] == list(range(1, 9))  # steps 4-5 of the killed run moved aside
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]
    assert len((tmp_path / "resumed" / "metrics.discarded.jsonl").read_text().splitlines()) == 2


def test_lora_trains_adapter_and_mask_row_and_merges(tiny_dir, data_file, tmp_path):
    from transformers import AutoModelForCausalLM

    train(_config(tiny_dir, data_file, tmp_path / "lora", max_steps=3, lora=True, lora_rank=4, lr=1e-2))
    assert (tmp_path / "lora" / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    assert merged.config.mask_token_id == 63
    emb_base, emb = base.get_input_embeddings().weight, merged.get_input_embeddings().weight
    assert not torch.allclose(emb[63], emb_base[63])  # the mask row is trained
    torch.testing.assert_close(emb[:63], emb_base[:63])  # the other rows are frozen
    q_base = base.model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(merged.model.layers[0].self_attn.q_proj.weight, q_base)  # LoRA merged in


def test_an_adapter_records_its_base_as_the_run_named_it(tiny_dir, data_file, tmp_path, monkeypatch):
    """A base that was built (a GGUF file, read back from this machine's build cache) is recorded as the run
    named it, so that the adapter loads on another machine."""
    from peft import LoraConfig, get_peft_model

    from refusion.model.adapter import adapter_base
    from refusion.model.tiny import tiny_model
    from refusion.train.trainer import save_adapter

    model = tiny_model()
    model.config.name_or_path = str(tmp_path / "build-cache" / "base-float32-0123")  # where it was read from
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    save_adapter(peft_model, tmp_path / "by-path", _config(tiny_dir, data_file, tmp_path / "run"))
    assert adapter_base(tmp_path / "by-path") == str(Path(tiny_dir).resolve())
    monkeypatch.chdir(Path(tiny_dir).parent)  # a relative path is recorded absolute
    save_adapter(peft_model, tmp_path / "relative", _config(Path(tiny_dir).name, data_file, tmp_path / "run"))
    assert adapter_base(tmp_path / "relative") == str(Path(tiny_dir).resolve())
    save_adapter(peft_model, tmp_path / "by-alias", _config("smollm2", data_file, tmp_path / "run"))
    assert adapter_base(tmp_path / "by-alias") == "smollm2"


def _run(argv, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # two processes, each loading torch and the model
def test_two_process_cpu_run(tiny_dir, data_file, tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    out, trace = tmp_path / "ddp", tmp_path / "trace"
    # --standalone: a rendezvous on localhost with a port the OS picks (no fixed port to collide on)
    proc = _run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "refusion.train.cli",
                 "--model", str(tiny_dir), "--data", str(data_file), "--output", str(out), "--max-steps", "4",
                 "--batch-size", "4", "--num-workers", "0", "--save-every", "2", "--lr", "3e-3"],
                env_extra={"REFUSION_TRAIN_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [[i for line in (trace / f"rank{r}.jsonl").read_text().splitlines() for i in json.loads(line)["samples"]]
            for r in range(2)]
    assert len(seen[0]) == len(seen[1]) == 16 and not set(seen[0]) & set(seen[1])  # different data
    summary = json.loads((out / "refusion_train.json").read_text())
    assert summary["processes"] == 2 and summary["ranks_in_sync"]  # the model stays in sync
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3, 4]
    assert (out / "checkpoints" / "step-0000004" / "trainer_state.json").is_file()


def test_lora_adapters_load_as_models_and_seed_a_new_run(tiny_dir, data_file, tmp_path):
    import refusion

    train(_config(tiny_dir, data_file, tmp_path / "a", max_steps=4, save_every=2, lora=True, lora_rank=4, lr=1e-2))
    snapshot = tmp_path / "a" / "checkpoints" / "step-0000004" / "adapter"
    assert (tmp_path / "a" / "checkpoints" / "step-0000002" / "adapter" / "adapter_config.json").is_file()
    ids = torch.tensor([[1, 5, 9, 63, 63]])
    logits = {}
    for name, path in [("merged", tmp_path / "a"), ("adapter", tmp_path / "a" / "adapter"), ("snapshot", snapshot)]:
        model, tokenizer = refusion.load(path, dtype="float32", device="cpu")
        assert tokenizer.convert_tokens_to_ids("<|mask|>") == 63
        logits[name] = model(ids).logits
    torch.testing.assert_close(logits["adapter"], logits["merged"])
    torch.testing.assert_close(logits["snapshot"], logits["merged"])
    base, _ = refusion.load(tiny_dir, dtype="float32", device="cpu")
    assert not torch.allclose(base(ids).logits, logits["merged"])

    # a new run seeded with the adapter starts where the first one ended
    train(_config(tiny_dir, data_file, tmp_path / "b", max_steps=1, lora=True, lora_init=str(tmp_path / "a" / "adapter"),
                  lr=1e-9))
    fresh = train(_config(tiny_dir, data_file, tmp_path / "c", max_steps=1, lora=True, lora_rank=4, lr=1e-9))
    assert _metrics(tmp_path / "b")[0]["loss"] < fresh.final_metrics["loss"]  # same batch, trained adapter
    # shipped form: bf16 tensors (half the bytes), portable base; loads to the same model up to bf16 rounding
    from refusion.cli import main as cli_main

    assert cli_main(["export-adapter", str(tmp_path / "a" / "adapter"), str(tmp_path / "ship")]) == 0
    shipped = json.loads((tmp_path / "ship" / "adapter_config.json").read_text())
    assert shipped["base_model_name_or_path"] == str(tiny_dir)
    size = {p: (p / "adapter_model.safetensors").stat().st_size for p in (tmp_path / "a" / "adapter", tmp_path / "ship")}
    assert size[tmp_path / "ship"] < 0.6 * size[tmp_path / "a" / "adapter"]
    model, _ = refusion.load(tmp_path / "ship", dtype="float32", device="cpu")
    rounding = (model(ids).logits - logits["merged"]).abs().max()
    assert rounding < 0.05 * (base(ids).logits - logits["merged"]).abs().max()
    assert cli_main(["export-adapter", str(tmp_path / "a" / "adapter"), str(tmp_path / "ship")]) == 2  # not clobbered
    with pytest.raises(ValueError, match="lora_init"):
        _config(tiny_dir, data_file, tmp_path / "d", lora=True, lora_init=str(tmp_path))
    with pytest.raises(ValueError, match="needs --lora"):
        _config(tiny_dir, data_file, tmp_path / "d", lora_init=str(tmp_path / "a" / "adapter"))


def test_mask_gated_adapter_keeps_the_base_ar_path_and_drafts_with_the_adapter(tiny_dir, data_file, tmp_path):
    import refusion
    from refusion.config import DecodeConfig
    from refusion.model.adapter import adapter_gate
    from refusion.train.trainer import merge_adapter

    run = tmp_path / "gated"
    train(_config(tiny_dir, data_file, run, max_steps=3, save_every=3, lora=True, lora_rank=4, lr=3e-2,
                  lora_gate="mask"))
    assert adapter_gate(run / "adapter") == "mask" == adapter_gate(run / "checkpoints" / "step-0000003" / "adapter")
    assert not (run / "config.json").exists()  # never merged
    base, _ = refusion.load(tiny_dir, dtype="float32", device="cpu")
    gated, tokenizer = refusion.load(run / "adapter", dtype="float32", device="cpu")
    mask = tokenizer.convert_tokens_to_ids("<|mask|>")
    clean, masked = torch.tensor([[1, 5, 9, 12, 40]]), torch.tensor([[1, 5, 9, mask, mask]])
    with torch.no_grad():
        # clean tokens: the base's logits bit for bit (the mask itself is never predicted)
        keep = torch.arange(base.config.vocab_size) != mask
        assert torch.equal(gated(clean).logits[..., keep], base(clean).logits[..., keep])
        assert torch.isneginf(gated(clean).logits[..., mask]).all()
        # mask rows: the adapter's; rows before the masks: still the base's
        gated_logits, base_logits = gated(masked).logits, base(masked).logits
        assert torch.equal(gated_logits[:, :3, keep], base_logits[:, :3, keep])
        assert not torch.allclose(gated_logits[:, 3:, keep], base_logits[:, 3:, keep])
        # inference (the update at every narrow row times the 0/1 gate) computes what training computed
        # (gated peft layers)
        from peft import PeftModel

        from refusion.model.adapter import gate_lora_at_masks
        from refusion.model.kernels.gated_lora import MaskGatedLoRA
        from refusion.model.kernels.narrow import MAX_ROWS
        from refusion.model.prepare import add_mask_token

        trained_base, trained_tokenizer = refusion.load(tiny_dir, dtype="float32", device="cpu",
                                                        implementation="transformers")  # peft wraps it
        add_mask_token(trained_base, trained_tokenizer)
        trained = PeftModel.from_pretrained(trained_base, str(run / "adapter"))
        gate_lora_at_masks(trained, mask)
        torch.testing.assert_close(trained(masked).logits[..., keep], gated_logits[..., keep])
        # masks in two runs, between clean tokens: still the training-time function
        split = torch.tensor([[1, mask, 9, mask, 40]])
        torch.testing.assert_close(trained(split).logits[..., keep], gated(split).logits[..., keep])
        assert next(m for m in gated.modules() if isinstance(m, MaskGatedLoRA)).mask_rows.gated
        # a wide forward (past the narrow range, the update goes through index_add) computes the same
        wide = masked.repeat(MAX_ROWS // masked.shape[1] + 1, 1)
        torch.testing.assert_close(gated(wide).logits[-1:, :, keep], gated_logits[..., keep])
        # bf16 (the update still computed in fp32): clean rows the bf16 base's; a model cast after loading
        # (its fp32 update buffers cast with it) still runs
        gated16, _ = refusion.load(run / "adapter", dtype="bfloat16", device="cpu")
        base16, _ = refusion.load(tiny_dir, dtype="bfloat16", device="cpu")
        assert torch.equal(gated16(masked).logits[:, :3, keep], base16(masked).logits[:, :3, keep])
        assert not torch.equal(gated16(masked).logits[:, 3:, keep], base16(masked).logits[:, 3:, keep])
        cast, _ = refusion.load(run / "adapter", dtype="float32", device="cpu")
        assert torch.isfinite(cast.to(torch.bfloat16)(masked).logits[..., keep]).all()
    prompts = [[1, 5, 9], [2, 7, 7, 30, 11]]
    ar = refusion.generate(base, prompts, DecodeConfig(strategy="autoregressive", max_new_tokens=24))
    for cfg in (DecodeConfig(strategy="autoregressive", max_new_tokens=24),
                DecodeConfig(strategy="speculative", draft_length=3, predraft=True, max_new_tokens=24)):
        assert refusion.generate(gated, prompts, cfg).sequences == ar.sequences
    with pytest.raises(ValueError, match="mask-gated"):
        merge_adapter(run / "adapter", tmp_path / "merged")
    from refusion.cli import main as cli_main  # the shipped (bf16) copy is still mask-gated

    assert cli_main(["export-adapter", str(run / "adapter"), str(tmp_path / "ship")]) == 0
    assert adapter_gate(tmp_path / "ship") == "mask"
    # cut to a lower rank: still mask-gated (clean rows the base's), the mask rows the full rank's at rank 4
    for rank in (4, 1):
        target = tmp_path / f"rank{rank}"
        assert cli_main(["export-adapter", str(run / "adapter"), str(target), "--rank", str(rank),
                         "--dtype", "float32"]) == 0
        cut, _ = refusion.load(target, dtype="float32", device="cpu")
        with torch.no_grad():
            cut_logits = cut(masked).logits
            assert torch.equal(cut_logits[:, :3, keep], base_logits[:, :3, keep])
        if rank == 4:
            torch.testing.assert_close(cut_logits[..., keep], gated_logits[..., keep], rtol=1e-4, atol=1e-4)
        else:
            assert not torch.allclose(cut_logits[..., keep], gated_logits[..., keep], rtol=1e-4, atol=1e-4)
    assert cli_main(["export-adapter", str(run / "adapter"), str(tmp_path / "r5"), "--rank", "5"]) == 2
    (tmp_path / "ship" / "refusion_adapter.json").write_text('{"lora_gate": "everywhere"}')
    with pytest.raises(ValueError, match="lora_gate='everywhere'"):
        refusion.load(tmp_path / "ship", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="needs --lora"):
        _config(tiny_dir, data_file, tmp_path / "d", lora_gate="mask")
