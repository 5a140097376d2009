"""`refusion generate`: decode prompts from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

from refusion.arguments import (
    add_decode_arguments,
    add_model_arguments,
    check_text,
    decode_config_from_args,
    load_from_args,
)
from refusion.data import BUILTIN_DATASETS
from refusion.decode.stream import ResponseStream, response_text
from refusion.engine.answers import add_keep_alive_argument
from refusion.jsonl import jsonl_records, not_utf8


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with ReFusion (or AR) decoding",
                              description="Generate a response for each PROMPT ('-' reads one from stdin), or "
                                          "for every record of --input, written to --output.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT")
    p.add_argument("--input", default=None, metavar="JSONL",
                   help='prompts from a JSONL file of {"prompt": ...} (or "query") records, or the questions of a '
                        f"built-in train/validation set ({', '.join(BUILTIN_DATASETS)}) in `refusion eval`'s prompt "
                        "format; distill-mix interleaves all the others; open-ended (open-ended-test: its held-out "
                        "part; open-ended-extra, -extra-2, -extra-3, -extra-4: 920, 1,841, 1,375 and 9,864 more, for "
                        "training only) "
                        "composed requests with little to copy (refusion/open_ended.py)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="with --input: only the first N prompts")
    p.add_argument("--skip", type=int, default=0, metavar="M",
                   help="with --input: leave out the first M prompts (with --limit N: prompts M+1..N); --output "
                        "then holds the answers from prompt M+1 on")
    p.add_argument("--output", default=None, metavar="JSONL",
                   help='with --input: write {"query", "response", "origin", "stats"} lines here (the training data '
                        "format; origin is the prompt's file:line); an existing file is continued, never overwritten")
    p.add_argument("--batch-size", type=int, default=8,
                   help="with --input: prompts decoding at once; new ones join when half have finished (default 8)")
    add_model_arguments(p)
    add_keep_alive_argument(p)
    add_decode_arguments(p)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain every response to JSON following the schema in FILE (strategy speculative or "
                        "autoregressive; needs llguidance)")
    p.add_argument("--stats", action="store_true", help="print tokens, forwards, tokens/forward and tokens/s")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--trace", metavar="PATH", default=None,
                   help="save the decoding trace (every round of every prompt, one file) as JSON; "
                        "render it with `refusion trace PATH`")
    p.add_argument("--show", action="store_true", help="watch the canvas fill in, round by round (on stderr)")
    p.set_defaults(func=run)


def setup_line(model, cfg) -> str:
    """`ModelSetup.describe()` of the model, saying whether the drafts `cfg`'s strategy verifies are priced (the
    forward costs the decoder will look up: `decode.costs.forward_costs_of`)."""
    from refusion.decode.costs import forward_costs_of
    from refusion.model.setup import setup_of

    setup = setup_of(model)
    priced = None
    if cfg.strategy != "autoregressive" and (setup.forward_costs is not None or setup.recorded_costs):
        priced = forward_costs_of(model, setup) is not None
    return setup.describe(drafts_priced=priced)


def run(args: argparse.Namespace) -> int:
    if args.input or args.output:
        return run_file(args)
    if not args.prompts:
        raise ValueError("no prompt: give PROMPT arguments, '-' for stdin, or --input FILE")
    prompts = [read_stdin() if p == "-" else p for p in args.prompts]
    if any(not p.strip() for p in prompts):
        raise ValueError("empty prompt: give some text to respond to")
    for i, prompt in enumerate(prompts):
        check_text(prompt, f"prompt {i + 1}" if len(prompts) > 1 else "the prompt")
    check_text(args.system, "--system")
    schema = read_json_schema(args.json_schema) if args.json_schema else None
    cfg = decode_config_from_args(args)  # validated before the model loads
    if through_engine(args):
        prompts = prompts[generate_through_engine(args, prompts, cfg, streams_answers(args)):]
        if not prompts:
            return 0
    from refusion.decode.loop import generate
    from refusion.model.loading import encode_prompts

    if args.trace:
        from refusion.viz.schema import check_writable
        check_writable(args.trace)
    model, tokenizer = load_from_args(args)
    input_ids = encode_prompts(tokenizer, prompts, chat=not args.no_chat, system=args.system)
    structured = {}
    if schema is not None:
        structured = dict(response_format={"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}},
                          tokenizer=tokenizer)
    if args.stats and not args.json:  # the numbers in force: dtype and kernels (the same on every run of a machine)
        print(f"[{setup_line(model, cfg)}]", flush=True)
    streamed = streams_answers(args)
    if args.show:
        from refusion.viz.terminal import LiveView
        with LiveView(tokenizer, prompts) as view:
            out = generate(model, input_ids, cfg, trace=bool(args.trace), on_round=view, **structured)
            view.finish(out)
    elif streamed:
        answers = StreamedAnswers(tokenizer, prompts, cfg if args.stats else None)
        try:
            out = generate(model, input_ids, cfg, trace=bool(args.trace), on_round=answers, **structured)
        except KeyboardInterrupt:
            _write_stdout("\n")  # the interrupted answer's line ends before the one-line notice
            raise
        answers.finish(out)
    else:
        out = generate(model, input_ids, cfg, trace=bool(args.trace), **structured)
    if args.trace:
        from refusion.viz.schema import build_trace, save_trace
        doc = build_trace(out, tokenizer, prompts, input_ids, cfg, model=args.model or "(embedded)")
        save_trace(doc, args.trace)
    if streamed:
        return 0
    for i, (prompt, tokens) in enumerate(zip(prompts, out.sequences)):
        text = response_text(tokenizer, tokens)
        stats = out.stats.per_sequence[i]
        if args.json:
            record = {"prompt": prompt, "text": text, "token_ids": tokens, "stats": stats.to_dict(),
                      "config": dataclasses.asdict(cfg)}
            if out.logprobs is not None:
                record["logprobs"] = [dataclasses.asdict(lp) for lp in out.logprobs[i]]
            print(json.dumps(record))
            continue
        if len(prompts) > 1:
            print(answer_header(i, prompt))
        print(text)
        if args.stats:
            print(stats_line(cfg, stats))
    return 0


def generate_through_engine(args, prompts: list[str], cfg, streamed: bool) -> int:
    """`refusion generate PROMPT...` through the engine. Returns how many prompts were answered: all of them, or
    fewer when the engine went away (the caller answers the rest in-process)."""
    from refusion.engine.answers import (
        answer,
        engine_settings,
        load_model,
        notice,
        open_engine,
        request,
        write_stdout,
    )
    from refusion.engine.client import EngineDied, EngineRefused, EngineUnavailable, load_spec

    cfg_body = engine_settings(cfg)
    opened = open_engine(args, "generate") if cfg_body is not None else None
    if opened is None:
        return 0
    engine, keep_alive = opened
    spec = load_spec(args)
    try:
        card = load_model(engine, spec, keep_alive, cfg.strategy, "generate")
    except EngineRefused as e:
        raise ValueError(str(e)) from None  # the model itself cannot be loaded: the same error in-process
    except EngineUnavailable as e:
        notice(f"refusion generate: {e}; decoding in this process")
        return 0
    if args.stats:
        print(f"[{card['setup']}]", flush=True)
    chat = not args.no_chat and card["chat_template"]
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            write_stdout(answer_header(i, prompt) + "\n")
        path, body = request(prompt, cfg_body, chat=chat, system=args.system)
        try:
            result = answer(engine, path, body, spec, keep_alive, write=write_stdout if streamed else None)
        except EngineDied as e:
            write_stdout("\n" if streamed else "")
            notice(f"refusion generate: {e}; answering again in this process")
            return i
        except EngineRefused as e:
            raise ValueError(str(e)) from None  # the engine refused the request: the same error in-process
        except EngineUnavailable as e:
            notice(f"refusion generate: {e}; answering again in this process")
            return i
        write_stdout("\n" if streamed else result.text + "\n")
        if args.stats and result.stats is not None:
            write_stdout(stats_line(cfg, result.stats) + "\n")
    return len(prompts)


def through_engine(args: argparse.Namespace) -> bool:
    """Whether the resident engine answers (`refusion.engine`): plain prompts, printed as text; a trace, the live
    view, --json and --json-schema decode in this process."""
    return not (args.trace or args.show or args.json or args.json_schema)


def streams_answers(args: argparse.Namespace) -> bool:
    """Whether the answers print as they are committed: on a terminal, unless --json or --show asks otherwise
    (piped output is printed whole, as it always was)."""
    return sys.stdout.isatty() and not args.json and not args.show


def answer_header(i: int, prompt: str) -> str:
    """The line before answer `i` when several prompts are answered."""
    return f"--- [{i}] {prompt}"


class StreamedAnswers:
    """`generate`'s `on_round` on a terminal: each answer's committed text is written as it grows, in prompt order,
    with the header and stats lines piped output has (the same text, once all is written).

    The first unfinished answer streams; later ones are kept until it is done, then write what they hold and stream
    on. An answer is done when its sequence has finished (seen at the next round of any sequence, or at `finish`).
    """

    def __init__(self, tokenizer, prompts: list[str], stats_cfg=None, write=None):
        """`stats_cfg`: the DecodeConfig whose stats line follows each answer (None: no stats line)."""
        self.write = write or _write_stdout
        self.prompts, self.stats_cfg = prompts, stats_cfg
        self.held = ["" for _ in prompts]  # text of answers waiting for their turn
        self.streams = [ResponseStream(tokenizer, self._writer(i)) for i in range(len(prompts))]
        self.seqs = [None for _ in prompts]
        self.head = 0  # the answer being written
        self._start_answer()

    def _writer(self, i: int):
        def write(text: str) -> None:
            if i == self.head:
                self.write(text)
            else:
                self.held[i] += text
        return write

    def __call__(self, seq, rnd) -> None:
        self.seqs[seq.id] = seq  # generate adds prompt i as sequence i
        self.streams[seq.id].update(seq.contiguous_response())
        while self.head < len(self.prompts) and self.seqs[self.head] is not None and self.seqs[self.head].finished:
            seq = self.seqs[self.head]
            self._finish_answer(seq.response(), seq.stats)

    def finish(self, out) -> None:
        """Write every answer not yet done, from `generate`'s output."""
        while self.head < len(self.prompts):
            self._finish_answer(out.sequences[self.head], out.stats.per_sequence[self.head])

    def _start_answer(self) -> None:
        if len(self.prompts) > 1:
            self.write(answer_header(self.head, self.prompts[self.head]) + "\n")
        self.write(self.held[self.head])
        self.held[self.head] = ""

    def _finish_answer(self, tokens: list[int], stats) -> None:
        self.streams[self.head].finish(tokens)
        self.write("\n" if self.stats_cfg is None else f"\n{stats_line(self.stats_cfg, stats)}\n")
        self.head += 1
        if self.head < len(self.prompts):
            self._start_answer()


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def stats_line(cfg, stats) -> str:
    """One line on where the forwards went: strategy, tokens, forwards per phase, drafts accepted, speed."""
    phases = ", ".join(f"{phase} {n}" for phase, n in stats.phase_forwards.items() if n)
    drafts = f" | drafts accepted {stats.accepted}/{stats.drafted}" if stats.drafted else ""
    return (f"[{cfg.strategy} | tokens {stats.tokens} | forwards {stats.forwards} ({phases}) | tokens/forward "
            f"{stats.tokens_per_forward:.2f}{drafts} | tokens/s {stats.tokens_per_second:.1f} | "
            f"{stats.seconds:.2f} s | {stats.finish_reason}]")


def read_json_schema(path: str) -> dict:
    """The JSON schema of --json-schema, read before the model loads (a file that is missing, not UTF-8 or not JSON
    is a one-line error)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise not_utf8(f"--json-schema {path}", e) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def read_stdin() -> str:
    """The prompt on stdin, read as UTF-8 (another encoding is a one-line error, not a tokenizer traceback)."""
    raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}): "
                         "convert it first, e.g. with iconv") from None


def read_prompt_file(path: str) -> list[tuple[str, str]]:
    """(origin, prompt) of each record of a JSONL file of {"prompt": ...} or {"query": ...} records (origin: the
    record's "origin" string, else "file:line"; errors name the line), or of a built-in prompt set when `path` is
    its name and no such file exists."""
    from refusion.data import builtin_train_pairs
    from refusion.open_ended import SPLITS, open_ended_prompts

    if path in BUILTIN_DATASETS and not os.path.exists(path):
        return [(origin, query) for origin, query, _ in builtin_train_pairs(path)]
    if path in SPLITS and not os.path.exists(path):
        return open_ended_prompts(SPLITS[path])
    prompts = []
    for number, record in jsonl_records(path):
        prompt = record.get("prompt", record.get("query")) if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f'{path}:{number}: expected a non-empty "prompt" (or "query") string')
        origin = record.get("origin")  # a generate --output line keeps its prompt's origin
        prompts.append((origin if isinstance(origin, str) else f"{path}:{number}", prompt))
    return prompts


def count_done(output: str, prompts: list[tuple[str, str]]) -> int:
    """How many records an existing --output holds, after checking that they answer the first prompts in order
    (a file made from other prompts, or by another --input, is refused rather than continued)."""
    if not os.path.exists(output):
        return 0
    try:
        records = list(jsonl_records(output))
    except ValueError as e:
        raise ValueError(f"{e}: not a generate record (an interrupted write? delete that line and run again)") from None
    for i, (number, record) in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{output}:{number}: not a generate record (a JSON object with the prompt's \"query\")")
        if i < len(prompts) and record.get("query") != prompts[i][1]:
            raise ValueError(f"{output}:{number}: answers another prompt than --input's record {i + 1} "
                             f"({prompts[i][0]}): give a new --output to start afresh")
    return len(records)


def run_file(args: argparse.Namespace) -> int:
    """Decode every prompt of --input, appending one JSON line per prompt to --output, in --input's order.

    Continuous batching: up to --batch-size prompts decode at once; whenever half of them have finished, as many
    new prompts join (one wide prefill forward for the newcomers instead of one per prompt). Record i is sampled
    with seed + i (at temperature > 0 with --seed), whatever its neighbours, so a resumed run writes what an
    uninterrupted one would have."""
    from tqdm import tqdm

    from refusion.decode.loop import Decoder
    from refusion.model.loading import encode_prompts
    from refusion.model.setup import setup_of

    if not (args.input and args.output):
        raise ValueError("--input and --output go together")
    if args.prompts:
        raise ValueError("give either PROMPT arguments or --input, not both")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size} is invalid: must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit={args.limit} is invalid: must be >= 1")
    if args.skip < 0 or (args.limit is not None and args.skip >= args.limit):
        raise ValueError(f"--skip={args.skip} is invalid: must be >= 0 and below --limit")
    if os.path.isdir(args.output):
        raise ValueError(f"--output {args.output} is a directory: give a JSONL file")
    check_text(args.system, "--system")
    prompts = read_prompt_file(args.input)[args.skip:args.limit]
    done = count_done(args.output, prompts)
    cfg = decode_config_from_args(args)
    if done >= len(prompts):
        print(f"{args.output} already holds {done} responses for {len(prompts)} prompts: nothing to do")
        return 0
    model, tokenizer = load_from_args(args)
    ids = encode_prompts(tokenizer, [prompt for _, prompt in prompts[done:]], chat=not args.no_chat, system=args.system)
    tokens = setup_of(model).special_tokens.for_decoding(cfg)
    decoder = Decoder(model)  # the cache grows (and compacts) as prompts come and go
    waiting, index_of, answered, written = iter(range(done, len(prompts))), {}, {}, done
    with open(args.output, "a", encoding="utf-8") as out_file, tqdm(total=len(prompts), initial=done,
                                                                    desc="generate") as bar:
        while True:
            if len(decoder.live) <= args.batch_size // 2:
                for i in itertools.islice(waiting, args.batch_size - len(decoder.live)):
                    seq = decoder.add(ids[i - done], cfg, mask_token_id=tokens.mask_token_id,
                                      eos_token_ids=list(tokens.eos_token_ids), index=i)
                    index_of[seq.id] = i
            if not decoder.live:
                break
            for seq in decoder.step():
                answered[index_of.pop(seq.id)] = seq
            while written in answered:  # records go out in --input's order
                seq = answered.pop(written)
                origin, prompt = prompts[written]
                text = response_text(tokenizer, seq.response())
                out_file.write(json.dumps({"query": prompt, "response": text, "origin": origin,
                                           "stats": seq.stats.to_dict()}) + "\n")
                out_file.flush()
                written += 1
                bar.update(1)
    return 0
