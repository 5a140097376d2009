"""lm-evaluation-harness model `refusion`: ReFusion decoding for `generate_until`, AR scoring for log-likelihoods.

    lm_eval --model refusion --model_args pretrained=PATH,slot_size=8,slot_threshold=0.9 --tasks gsm8k

lm-eval finds the model through the `lm_eval.models` entry point of this package (lm-eval releases with
entry-point discovery), or by importing this module, which registers it: with lm-eval 0.4.13 and older,
run `python -m refusion.eval.lm_eval_plugin ARGS` instead of `lm_eval ARGS` (same arguments).

Model arguments: `pretrained` (path / alias / hub id; omitted: the embedded default model), `dtype`, `device`,
`batch_size`, `preset`, and every DecodeConfig field by its name (`strategy`, `slot_size`, `block_size`,
`slot_threshold`, `token_threshold`, `temperature`, `seed`, `kv_cache`, `max_new_tokens`, `draft_length`, ...;
values as on the command line, e.g. `fused_plan=false`, `eos_token_id=2,7`). A task's `max_gen_toks` replaces
`max_new_tokens`; its `until` strings cut the response.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from refusion.config import DecodeConfig, field_types, layered_config, parse_value

DECODE_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeConfig))
"""The model arguments that are DecodeConfig fields: all of them."""


@register_model("refusion")
class ReFusionLM(TemplateLM):
    """A ReFusion model behind lm-eval's `LM` interface."""

    def __init__(self, pretrained: str | None = None, *, model=None, tokenizer=None, dtype: str | None = None,
                 device: str | None = None, batch_size: int | str = 1, preset: str | None = None,
                 max_length: int | None = None, **decode) -> None:
        super().__init__()
        unknown = sorted(set(decode) - set(DECODE_FIELDS) - {"max_batch_size", "trust_remote_code"})
        if unknown:
            raise ValueError(f"unknown refusion model_args {unknown}: use {', '.join(DECODE_FIELDS)}")
        self.decode_config = layered_config(preset, explicit=decode_settings(decode))
        if model is None:
            from refusion.model.loading import load
            model, tokenizer = load(pretrained, dtype=dtype, device=_device(device))
        if tokenizer is None:
            raise ValueError("a model object needs its tokenizer: pass tokenizer=...")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = int(str(batch_size).split(":")[0]) if str(batch_size) not in ("auto", "None") else 1
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", 2048)
        self._device = next(model.parameters()).device
        self._rank, self._world_size = 0, 1

    # -- tokenizer ------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        from refusion.model.setup import setup_of

        eos = setup_of(self.model).special_tokens.eos_token_id
        return eos if eos is not None else self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # a chat-templated context already holds its special tokens
            bos = self.tokenizer.bos_token
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"]

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "refusion").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # -- generation: ReFusion decoding ------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode each context with `refusion.generate`; cut the text at the first `until` string."""
        from tqdm import tqdm

        from refusion.decode.loop import generate

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):  # same generation settings -> same batch
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="refusion generate_until")
        for _key, indices in groups.items():
            gen_kwargs = dict(requests[indices[0]].args[1])
            cfg, until = self._generation_settings(gen_kwargs)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                ids = [self.tok_encode(requests[i].args[0]) for i in chunk]
                out = generate(self.model, ids, cfg)
                for i, seq in zip(chunk, out.sequences, strict=True):
                    text = cut_at_stop(self.tokenizer.decode(seq, skip_special_tokens=True), until)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def _generation_settings(self, gen_kwargs: dict) -> tuple[DecodeConfig, list[str]]:
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        changes = {}
        if gen_kwargs.get("max_gen_toks"):
            changes["max_new_tokens"] = int(gen_kwargs["max_gen_toks"])
        if gen_kwargs.get("do_sample") is False or "temperature" in gen_kwargs:
            changes["temperature"] = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
        return self.decode_config.replace(**changes), until

    # -- log-likelihoods: AR scoring (one causal forward per batch) -------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            scored = self._score_batch([(ctx, cont) for _, ctx, cont in chunk])
            for (key, _, _), result in zip(chunk, scored, strict=True):
                results.append(result)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    @torch.inference_mode()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether the continuation is the greedy one."""
        rows = [(ctx + cont)[-(self.max_length + 1):] for ctx, cont in pairs]
        inputs = [row[:-1] for row in rows]
        width = max(map(len, inputs))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(inputs), width), pad, dtype=torch.long)  # [B, T] right-padded
        mask = torch.zeros_like(ids)
        for b, row in enumerate(inputs):
            ids[b, :len(row)] = torch.tensor(row)
            mask[b, :len(row)] = 1
        logits = self.model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device)).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()  # [B, T, V]
        out = []
        for b, ((_, cont), row) in enumerate(zip(pairs, rows, strict=True)):
            n = len(cont)
            positions = torch.arange(len(row) - 1 - n, len(row) - 1)  # logits at t predict token t+1
            target = torch.tensor(row[-n:])
            lp = logprobs[b, positions]  # [n, V]
            out.append((float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        results = []
        for request in requests:
            (string,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(string, add_special_tokens=False), self.prefix_token_id, self.max_length, 1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows]))
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return results


def decode_settings(args: dict) -> dict:
    """The DecodeConfig fields among lm-eval's model arguments; text values (lm-eval passes what it could not
    read as a number or bool as a string) are read as the field's type."""
    types = field_types(DecodeConfig)
    return {k: parse_value(types[k], v) if isinstance(v, str) and types[k] is not str else v
            for k, v in args.items() if k in DECODE_FIELDS}


def _device(device: str | None) -> str | None:
    """lm-eval passes --device (default "cuda") even where there is no GPU: treat that as automatic."""
    if device in (None, "auto") or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        if device not in (None, "auto"):
            logging.getLogger(__name__).warning("device %s is not available: using the default device", device)
        return None
    return device


def cut_at_stop(text: str, until: list[str]) -> str:
    """`text` up to the earliest stop string."""
    cut = min((text.find(s) for s in until if s and s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def main() -> int:
    """`python -m refusion.eval.lm_eval_plugin ...`: lm-eval's command line with `refusion` registered."""
    from lm_eval.__main__ import cli_evaluate
    return cli_evaluate() or 0


if __name__ == "__main__":
    raise SystemExit(main())
