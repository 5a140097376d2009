"""The batching loop and `generate`: the only loop that drives the model.

Every live sequence runs its own decoding program (`programs/`); each step gathers the forward each
program asks for, runs them as one batched forward over the shared `SlotCache`, and hands every program
its logits. Sequences may be at different phases of a round; a finished sequence leaves the batch and
costs nothing more. New sequences can join between steps (continuous batching for the server).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from refusion.config import DecodeConfig, layered_config
from refusion.decode.acceptance import AcceptanceByFrequency
from refusion.decode.costs import draft_counts, drafting_may_pay, forward_costs_of
from refusion.decode.forward import CachedForward, padded_inputs
from refusion.decode.grammar import ResponseGrammar, check_strategy
from refusion.decode.outputs import BatchStats, GenerationOutput, GenerationStats, RoundTrace
from refusion.decode.prefix_cache import (
    ANSWER_STRATEGIES,
    PrefixCache,
    inexact_reason,
    model_dtype,
    namespace_of,
    narrowed,
)
from refusion.decode.programs import start_program
from refusion.decode.sampling import PositionNoise
from refusion.decode.sequence import DraftBound, DraftOffer, Forward, Program, Sequence
from refusion.model.compiled import bucket_width
from refusion.model.setup import ModelSetup, check_promise, setup_of


class PromptTooLong(ValueError):
    """A prompt plus the tokens asked for do not fit in the model's context."""


@dataclass
class Running:
    """A live sequence, its program, and the forward the program asked for (or the bound of its drafts, or the
    drafts it offers for it)."""

    seq: Sequence
    program: Program
    request: Forward | DraftBound | DraftOffer
    unstored_prompt: list[int] | None = None
    """The prompt, until its prefill's entries are stored in the decoder's prefix cache (None: nothing to store)."""


class Decoder:
    """Runs the decoding programs of many sequences, one batched forward per `step()`."""

    def __init__(self, model, capacity: int = 512, *, setup: ModelSetup | None = None,
                 prefix_cache: PrefixCache | None = None):
        """`setup`: what refusion added to the model (special tokens, draft table, ...); None: `setup_of(model)`.
        `prefix_cache`: where prompt prefixes' KV entries are kept across sequences (`decode.prefix_cache`; it may
        outlive the decoder); None: every prompt is prefilled whole. ValueError where reusing entries could change
        an answer (`prefix_cache.inexact_reason`)."""
        self.model = model
        self.setup = setup or setup_of(model)
        self.cached_forward = CachedForward(model, self.setup)  # each step's forward over the cache
        self.device, self.compiled = self.cached_forward.device, self.cached_forward.compiled
        self.compact = self.cached_forward.compact
        self.cache = self.cached_forward.new_cache(capacity)
        if prefix_cache is not None and (reason := inexact_reason(model, self.setup)) is not None:
            raise ValueError(f"prefix caching is off for this model: {reason}")
        self.prefix_cache = prefix_cache
        self._namespace = namespace_of(model, self.cache.kv_dtype) if prefix_cache is not None else None
        """The prefix cache's root for this model."""
        self.table_acceptance = AcceptanceByFrequency()
        """How the draft table's drafts fared in this decoder, by the frequency the table stated for each: every
        sequence's table drafter prices its drafts by it and records its verdicts in it, so what one answer teaches
        prices the next (docs/DECODING.md, "How far each sequence drafts")."""
        self.live: dict[int, Running] = {}
        self.stats = BatchStats()
        self._next_id = 0

    def add(self, prompt: list[int], cfg: DecodeConfig, *, mask_token_id: int | None, eos_token_ids: list[int],
            generator: torch.Generator | None = None, index: int = 0, trace: bool = False,
            on_round: Callable[[Sequence, RoundTrace], None] | None = None,
            grammar: ResponseGrammar | None = None) -> Sequence:
        """Start decoding a prompt; it joins the batch at the next step. `grammar`: the response's structured-output
        grammar (AR and exact mode only; `ResponseGrammar.compile`), or None.

        The prompt is validated here (a bad one raises before any forward). At temperature > 0 the sequence samples
        with seed cfg.seed + index (at random when cfg.seed is None; with `generator`: plan and infill draws from it,
        AR decoding and the exact mode draw their seed from it): `sequence_generator`, `sequence_noise`.
        """
        validate_prompts(self.model, [prompt], cfg, mask_token_id, first_index=index)
        if grammar is not None:
            check_strategy(cfg.strategy)
        noise = sequence_noise(cfg, index, generator, self.device)
        generator = sequence_generator(cfg, index, generator, self.device) if noise is None else None
        seq = Sequence(self._next_id, prompt, cfg, mask_token_id=mask_token_id, eos_token_ids=eos_token_ids,
                       cache=self.cache, device=self.device, generator=generator, trace=trace, on_round=on_round,
                       draft_table=self.setup.draft_table, grammar=None if grammar is None else grammar.state(),
                       forward_costs=self._forward_costs(cfg), noise=noise, table_acceptance=self.table_acceptance)
        self._next_id += 1
        try:
            if self.prefix_cache is not None:
                self._reuse_prefix(seq, prompt)
            program = start_program(seq)
            self.live[seq.id] = Running(seq, program, next(program),
                                        unstored_prompt=list(prompt) if self.prefix_cache is not None else None)
        except BaseException:
            self.cache.remove_sequences([seq.id])  # a row without a program would break the next step
            raise
        return seq

    def _reuse_prefix(self, seq: Sequence, prompt: list[int]) -> None:
        """The longest cached prefix of the prompt joins the sequence's context before its prefill."""
        hit = self.prefix_cache.lookup(self._namespace, prompt)
        if hit.length:
            seq.reuse_prefix(hit.keys, hit.values)
        seq.stats.cached_tokens = hit.length

    def _store_prompts(self, seq_ids: list[int]) -> None:
        """The prefix cache keeps the whole blocks of the prompts that were just committed (after the prefill)."""
        for seq_id in seq_ids:
            running = self.live[seq_id]
            prompt = running.unstored_prompt
            if prompt is None or self.cache.committed[seq_id] < len(prompt):
                continue
            running.unstored_prompt = None
            self._store_context(seq_id, prompt)

    def _store_answers(self, finished: list[Sequence]) -> None:
        """The prefix cache also keeps the whole blocks of a finished answer (after its prompt's), where its entries
        are what a prefill of it computes (`prefix_cache.ANSWER_STRATEGIES`): a chat's next turn, which resends the
        conversation, then prefills only its new message."""
        for seq in finished:
            if seq.cfg.strategy not in ANSWER_STRATEGIES:
                continue
            self._store_context(seq.id, seq.context_tokens(self.cache.committed[seq.id]))

    def _store_context(self, seq_id: int, text: list[int]) -> None:
        """The prefix cache keeps the whole blocks of `text` (the first tokens of the sequence's context) that it
        does not hold yet, from the sequence's context entries."""
        start, stop = self.prefix_cache.unstored(self._namespace, text)
        if start < stop:
            keys, values = self.cache.context_entries(seq_id, start, stop)
            dtype = model_dtype(self.model)
            self.prefix_cache.store(self._namespace, text, start, narrowed(keys, dtype), narrowed(values, dtype))

    def _forward_costs(self, cfg: DecodeConfig):
        """What prices a sequence's drafts (`decode.costs.forward_costs_of`: recorded once per machine and model);
        None in AR decoding, which drafts nothing."""
        return None if cfg.strategy == "autoregressive" else forward_costs_of(self.model, self.setup)

    def cancel(self, seq: Sequence) -> None:
        """Stop decoding a sequence (e.g. its client went away) and free its row (even if its program raises
        while closing)."""
        running = self.live.pop(seq.id, None)
        if running is not None:
            try:
                running.program.close()
            finally:
                self.cache.remove_sequences([seq.id])

    @torch.inference_mode()
    def step(self, on_error: Callable[[Sequence, Exception], None] | None = None) -> list[Sequence]:
        """Run one batched forward for every live sequence; return the sequences that finished.

        A sequence whose program raises leaves the batch (its row is freed) and is handed to
        `on_error(sequence, exception)` while the others go on; without `on_error` the exception propagates.
        """
        finished, failed = [], []
        self.settle_bounds(failed, raising=on_error is None)
        self.settle_offers(failed, raising=on_error is None)
        order = sorted(self.live, key=self.cache.row_of.get)
        if not order:
            return self.drop_failed(failed, on_error)
        requests = [self.live[i].request for i in order]
        logits = self.forward(requests)
        for seq_id, seq_logits in zip(order, logits):
            running = self.live[seq_id]
            seq = running.seq
            seq.stats.forwards += 1
            try:
                running.request = running.program.send(seq_logits)
            except StopIteration:
                finished.append(seq)
            except Exception as e:
                if on_error is None:
                    raise
                failed.append((seq, e))
        if self.prefix_cache is not None:
            failed_ids = {s.id for s, _ in failed}
            self._store_prompts([i for i in order if i not in failed_ids])
        for seq in finished:
            del self.live[seq.id]
            seq.finished = True
            seq.stats.seconds = time.perf_counter() - seq.started
        self.stats.tokens += sum(seq.stats.tokens for seq in finished)
        if self.prefix_cache is not None:
            self._store_answers(finished)
        self.cache.remove_sequences([s.id for s in finished])
        self.drop_failed(failed, on_error)
        return finished

    def settle_bounds(self, failed: list[tuple[Sequence, Exception]], raising: bool) -> None:
        """Whether any draft could pay in the step: the programs that bound their drafts (`DraftBound`) are sent
        `costs.drafting_may_pay` over every live sequence's bound and width, and yield their offers (or forwards).
        A program that raises leaves the batch into `failed` (`raising`: its exception propagates)."""
        bounding = [r for r in self.live.values() if isinstance(r.request, DraftBound)]
        if not bounding:
            return
        others = [r.request.tokens.numel() for r in self.live.values() if isinstance(r.request, Forward)]
        bounds = [(r.request.rows, r.request.gain_per_row) for r in bounding]
        costs = bounding[0].seq.forward_costs  # a program bounds only where its costs are known: the decoder's own
        may_pay = drafting_may_pay(bounds, others, costs, self.cache.used)
        self._send_each(bounding, [may_pay] * len(bounding), failed, raising)

    def settle_offers(self, failed: list[tuple[Sequence, Exception]], raising: bool) -> None:
        """The step's decision: the programs that offered drafts (`DraftOffer`) are sent how many of their items the
        step's forward verifies (`costs.draft_counts`, over every live sequence's rows) and yield their forwards. A
        program that raises leaves the batch into `failed` (`raising`: its exception propagates)."""
        offering = [r for r in self.live.values() if isinstance(r.request, DraftOffer)]
        if not offering:
            return
        others = [r.request.tokens.numel() for r in self.live.values() if not isinstance(r.request, DraftOffer)]
        costs = offering[0].seq.forward_costs  # a program offers only where its costs are known: the decoder's own
        counts = draft_counts([(r.request.width, r.request.items) for r in offering], others, costs, self.cache.used)
        self._send_each(offering, counts, failed, raising)

    def _send_each(self, waiting: list[Running], answers: list, failed: list[tuple[Sequence, Exception]],
                   raising: bool) -> None:
        """Send each waiting program its answer and keep what it yields next (a program that raises: `failed`)."""
        for running, answer in zip(waiting, answers):
            try:
                running.request = running.program.send(answer)
            except Exception as e:
                if raising:
                    raise
                failed.append((running.seq, e))
                del self.live[running.seq.id]

    def drop_failed(self, failed: list[tuple[Sequence, Exception]], on_error) -> list[Sequence]:
        """Free the rows of the sequences whose programs raised and hand each to `on_error`; [] (none finished)."""
        for seq, _ in failed:
            self.live.pop(seq.id, None)
        self.cache.remove_sequences([s.id for s, _ in failed])
        for seq, e in failed:
            on_error(seq, e)
        return []

    def run(self) -> None:
        """Step until every sequence has finished."""
        while self.live:
            self.step()

    def forward(self, requests: list[Forward]) -> list[torch.Tensor]:
        """One batched forward of `requests` (one per sequence of the cache, in cache-row order; right-aligned, i.e.
        left padding): the logits each asked for. `step` runs the programs' requests through it."""
        counts = [r.tokens.numel() for r in requests]
        batch, width = len(requests), max(counts)
        bucket = bucket_width(width) if self.compiled is not None else None
        width = bucket or width  # compiled: padded up to its bucket (padding is invisible and leaves no entry)
        branched = any(r.lower_upto is not None for r in requests)
        if batch == 1 and counts[0] == width and not branched:  # the request as it is: nothing to pad or copy
            r = requests[0]
            input_ids, positions, groups, lower_upto = r.tokens[None], r.positions[None], r.groups[None], None
        else:
            input_ids, positions, groups, lower_upto = padded_inputs(requests, width, branched, self.device)
        needs = [r.tokens.numel() - r.logits_from for r in requests]  # logits needed, counted from the end
        logits, seconds = self.cached_forward(self.cache, input_ids, positions, groups, lower_upto, counts, needs,
                                              bucket)
        self.stats.forward_seconds += seconds
        self.stats.forwards += 1
        return logits


# --------------------------------------------------------------------------------- generate
def check_generate_arguments(model, cfg, trace, generator, setup, on_round) -> None:
    """`generate`'s arguments other than the prompts, each checked for its type (a one-line ValueError naming the
    argument)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model must be a transformers causal LM (refusion.load returns one), not "
                         f"{type(model).__name__}")
    if cfg is not None and not isinstance(cfg, DecodeConfig):
        raise ValueError(f"cfg must be a refusion.DecodeConfig (or None), not {type(cfg).__name__}; "
                         "pass single settings as keywords: generate(model, ids, max_new_tokens=64)")
    if not isinstance(trace, bool):
        raise ValueError(f"trace must be True or False, not {trace!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, not {type(generator).__name__}")
    if setup is not None and not isinstance(setup, ModelSetup):
        raise ValueError(f"setup must be a refusion.ModelSetup or None, not {type(setup).__name__}")
    if on_round is not None and not callable(on_round):
        raise ValueError(f"on_round must be callable or None, not {type(on_round).__name__}")


def default_config(setup: ModelSetup) -> DecodeConfig:
    """The config `generate` decodes with when given none: the model's own preset (`ModelSetup.preset`, the one the
    CLI uses for the embedded model), else the DecodeConfig defaults."""
    return DecodeConfig.from_preset(setup.preset) if setup.preset else DecodeConfig()


def response_grammar(model, cfg: DecodeConfig, response_format: dict | None, tokenizer,
                     eos_ids: list[int]) -> ResponseGrammar | None:
    """The compiled grammar of `generate`'s response_format (None for none or text), after checking that the
    strategy can honour it and that the tokenizer is given."""
    if response_format is None:
        return None
    if tokenizer is None:
        raise ValueError("response_format needs tokenizer=... (the model's) to build the grammar's tokens")
    check_strategy(cfg.strategy)
    vocab_size = model.config.get_text_config().vocab_size
    return ResponseGrammar.compile(tokenizer, response_format, vocab_size, eos_ids)


def normalize_prompts(input_ids, attention_mask=None) -> list[list[int]]:
    """A (B, P) tensor, a list of id lists (ragged batch) or one list of ids -> list of id lists.

    A padded (B, P) tensor needs its `attention_mask` (1 = token, 0 = padding, as a tokenizer returns it):
    padding is stripped, on either side. Without one, every id is taken as prompt text."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (batch, length) tensor, got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            return input_ids.tolist()
        attention_mask = torch.as_tensor(attention_mask)
        if attention_mask.dim() == 1:
            attention_mask = attention_mask[None]
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}: they must match")
        return [row[keep.bool()].tolist() for row, keep in zip(input_ids, attention_mask)]
    if attention_mask is not None:
        raise ValueError("attention_mask is only for a padded (batch, length) tensor; a list of id lists needs none")
    if not isinstance(input_ids, SequenceABC) or isinstance(input_ids, (str, bytes)):
        raise ValueError("input_ids must be a list of token-id lists or a (batch, length) LongTensor; "
                         "tokenize text first (refusion.encode_prompts)")
    if len(input_ids) and all(isinstance(t, int) for t in input_ids):
        return [list(input_ids)]
    prompts = [list(p.tolist() if isinstance(p, torch.Tensor) else p) for p in input_ids]
    if not prompts:
        raise ValueError("input_ids is empty: give at least one prompt")
    return prompts


def reject_padding(input_ids, pad_token_id: int | None) -> None:
    """A (B, P) tensor given without its attention_mask must not be padded: pad ids would be read as text."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] < 2 or pad_token_id is None:
        return
    padded = (input_ids[:, 0] == pad_token_id) | (input_ids[:, -1] == pad_token_id)
    if bool(padded.any()):
        row = int(padded.nonzero()[0])
        raise ValueError(f"input_ids row {row} starts or ends with the pad id {pad_token_id}, so the batch looks "
                         "padded: pass attention_mask=... (as the tokenizer returns it) or a list of id lists")


def validate_prompts(model, prompts: list[list[int]], cfg: DecodeConfig, mask_id: int | None,
                     first_index: int = 0) -> None:
    """Bad input fails here, with the field named, before any forward pass (prompts are numbered from
    `first_index`)."""
    text_config = model.config.get_text_config()
    vocab = model.get_input_embeddings().num_embeddings
    max_positions = getattr(text_config, "max_position_embeddings", None)
    new_tokens = cfg.canvas_length if cfg.strategy == "refusion" else cfg.max_new_tokens
    if mask_id is not None and not 0 <= mask_id < vocab:
        raise ValueError(f"mask_token_id={mask_id} is outside the model's vocabulary of {vocab}")
    for i, prompt in enumerate(prompts, first_index):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt {i} holds token ids outside [0, {vocab})")
        if max_positions is not None and len(prompt) + new_tokens > max_positions:
            raise PromptTooLong(f"prompt {i} ({len(prompt)} tokens) + max_new_tokens={cfg.max_new_tokens} "
                             f"(canvas {new_tokens}) exceeds the model's context of {max_positions} positions")


def sequence_seed(cfg: DecodeConfig, index: int) -> int:
    """The sampling seed of sequence `index` of a batch: cfg.seed + index, or at random when cfg.seed is None."""
    return cfg.seed + index if cfg.seed is not None else int(torch.randint(0, 2**62, (1,)))


def sequence_generator(cfg: DecodeConfig, index: int, generator: torch.Generator | None,
                       device: torch.device | str = "cpu") -> torch.Generator | None:
    """Plan and infill's random generator for sequence `index` (its plans draw from it in turn): none at temperature
    0; the one given; else a generator on `device` (where the logits are, so noise is drawn there) seeded with
    `sequence_seed`."""
    if cfg.temperature == 0:
        return None
    if generator is not None:
        return generator
    return torch.Generator(device=device).manual_seed(sequence_seed(cfg, index))


def sequence_noise(cfg: DecodeConfig, index: int, generator: torch.Generator | None,
                   device: torch.device | str = "cpu") -> PositionNoise | None:
    """AR decoding's and the exact mode's sampling noise for sequence `index` (`sampling.PositionNoise`: each
    position's draw keyed by the seed and the position, so the text does not depend on the batch or on the drafts
    verified): none at temperature 0 or for plan and infill; seeded with a seed drawn from `generator` when one is
    given, else with `sequence_seed`, on `device`."""
    if cfg.temperature == 0 or cfg.strategy == "refusion":
        return None
    if generator is not None:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    else:
        seed = sequence_seed(cfg, index)
    return PositionNoise(seed, device)


@torch.inference_mode()
def generate(model, input_ids, cfg: DecodeConfig | None = None, *, attention_mask=None, trace: bool = False,
             generator: torch.Generator | None = None, setup: ModelSetup | None = None,
             on_round: Callable[[Sequence, RoundTrace], None] | None = None, response_format: dict | None = None,
             tokenizer=None, **overrides) -> GenerationOutput:
    """Decode a batch of prompts with ReFusion plan-and-infill (or the AR baseline).

    Args:
        model: a transformers causal LM with RoPE that accepts `position_ids` (sdpa or eager attention).
        input_ids: a list of token-id lists (a ragged batch), one list of ids, or a (B, P) LongTensor.
        attention_mask: for a padded (B, P) tensor, 1 at tokens and 0 at padding (padding is stripped).
        cfg: decoding settings (None: the model's own preset, `ModelSetup.preset`, e.g. the embedded model's
            "refusion-smol", else the DecodeConfig defaults); keyword `overrides` replace single fields (e.g.
            ``max_new_tokens=64``).
        trace: also return, per sequence, what each round planned and committed.
        generator: random generator for every sequence when temperature > 0 (default: each sequence samples with
            seed cfg.seed + index). Plan and infill draws its plans' noise from it in turn; AR decoding and the
            exact mode draw each sequence's seed from it, in order.
        on_round: called after every round of every sequence with (sequence, RoundTrace).
        setup: what refusion adds to the model (special tokens, draft table, kernels: `refusion.model.setup`);
            None: `setup_of(model)`, the one `refusion.load` / `refusion.prepare` attached, or for a plain
            transformers model its tokens resolved from its configs. `cfg.mask_token_id` and `cfg.eos_token_id`,
            when set, replace its mask and EOS ids.
        response_format: structured output, as OpenAI's: `{"type": "json_object"}` or `{"type": "json_schema",
            "json_schema": {"name": ..., "schema": {...}}}` (`{"type": "text"}` or None: free text). Every
            response is then constrained to the grammar and ends with EOS once it is complete (docs/DECODING.md,
            "Structured output"); strategy "speculative" or "autoregressive" only (ValueError for "refusion").
            Needs `tokenizer`, the model's.
    """
    check_generate_arguments(model, cfg, trace, generator, setup, on_round)
    setup = setup or setup_of(model)
    cfg = cfg or default_config(setup)
    if overrides:  # the overrides are what this call set: fields the resulting strategy ignores warn
        cfg = layered_config(cfg.to_dict(), explicit=overrides)
    check_promise(model, setup, cfg.strategy)
    tokens = setup.special_tokens.for_decoding(cfg)
    if attention_mask is None:
        reject_padding(input_ids, tokens.pad_token_id)
    prompts = normalize_prompts(input_ids, attention_mask)
    mask_id, eos_ids = tokens.mask_token_id, list(tokens.eos_token_ids)
    grammar = response_grammar(model, cfg, response_format, tokenizer, eos_ids)
    was_training = model.training
    switched = any(m.training for m in model.modules())  # eval() walks every module: ~5 ms for 600 of them
    if switched:
        model.eval()
    start = time.perf_counter()
    try:
        decoder = Decoder(model, capacity=max(map(len, prompts)) + cfg.canvas_length + 2 * cfg.block_size,
                          setup=setup)
        seqs = [decoder.add(p, cfg, mask_token_id=mask_id, eos_token_ids=eos_ids, generator=generator, index=i,
                            trace=trace, on_round=on_round, grammar=grammar)
                for i, p in enumerate(prompts)]
        decoder.run()
    finally:
        if switched:
            model.train(was_training)
    sequences = [s.response() for s in seqs]
    batch = decoder.stats
    batch.seconds = time.perf_counter() - start
    stats = GenerationStats([s.stats for s in seqs], batch)
    logprobs = [s.response_logprobs() for s in seqs] if cfg.logprobs is not None else None
    return GenerationOutput(sequences, stats, [s.rounds for s in seqs] if trace else None, logprobs)
