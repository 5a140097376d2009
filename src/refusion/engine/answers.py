"""Answers through the resident engine, printed as the in-process command prints them: the same text, the same
setup and stats lines (counts from the engine's decoder), streamed on a terminal, whole when piped.

Light imports only (`refusion.config`, `refusion.decode.outputs`, the standard library): this is the path of every
warm command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from refusion.config import MODEL_FIELDS, OPENAI_NAMES, DecodeConfig, ignored_by
from refusion.decode.outputs import SequenceStats
from refusion.engine.client import Engine, EngineDied, EngineRefused, EngineUnavailable, connect, load_spec
from refusion.engine.place import parse_keep_alive

KEEP_ALIVE_HELP = ("keep the model loaded in a resident engine for this long after the answer, so that the next "
                   "command answers at once: seconds or 90s, 5m, 1h; 0 decodes in this process and starts no engine "
                   "(default: $REFUSION_KEEP_ALIVE, else 5m; `refusion ps` lists, `refusion stop` ends it)")


def add_keep_alive_argument(parser) -> None:
    parser.add_argument("--keep-alive", default=None, metavar="DURATION", help=KEEP_ALIVE_HELP)


@dataclass
class EngineAnswer:
    """One answer the engine gave."""

    text: str
    stats: SequenceStats | None
    """The decoder's statistics of the sequence (None when the engine sent none)."""


def engine_settings(cfg: DecodeConfig) -> dict | None:
    """The request fields that make the engine decode with `cfg`: the standard ones, then every field the strategy
    reads in the `"refusion"` extension (those it ignores were already warned about here). None when `cfg` needs
    the in-process path (a model field set by hand, or logprobs, which only --json prints)."""
    settings = cfg.to_dict()
    if any(settings[name] is not None for name in MODEL_FIELDS) or cfg.logprobs is not None:
        return None
    ignored = set(ignored_by(cfg.strategy))
    extension = {k: v for k, v in settings.items()
                 if k not in OPENAI_NAMES and k not in MODEL_FIELDS and k not in ignored and v is not None}
    body = {"max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "refusion": extension}
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    return body


def request(prompt: str, cfg_body: dict, *, chat: bool, system: str | None) -> tuple[str, dict]:
    """(path, body) of one streamed answer: a chat turn through the model's template, else the plain text."""
    body = {"model": "refusion", "stream": True, **cfg_body}
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": prompt}


def answer(engine: Engine, path: str, body: dict, spec: dict, keep_alive: float,
           write: Callable[[str], object] | None = None) -> EngineAnswer:
    """Stream one answer, `write`-ing each new piece of text as it comes."""
    text, stats = "", None
    for event in engine.stream(path, body, spec, keep_alive):
        for choice in event.get("choices", []):
            delta = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if delta:
                text += delta
                if write is not None:
                    write(delta)
            if choice.get("finish_reason") and isinstance(choice.get("refusion"), dict):
                stats = sequence_stats(choice["refusion"])
    return EngineAnswer(text, stats)


def sequence_stats(values: dict) -> SequenceStats:
    """The engine's per-choice statistics as the `SequenceStats` the stats line prints."""
    return SequenceStats(tokens=int(values.get("tokens", 0)), forwards=int(values.get("forwards", 0)),
                         rounds=int(values.get("rounds", 0)), seconds=float(values.get("seconds", 0.0)),
                         finish_reason=str(values.get("finish_reason", "length")),
                         phase_forwards=dict(values.get("phase_forwards", {})),
                         committed_by=dict(values.get("committed_by", {})),
                         drafted=int(values.get("drafted", 0)), accepted=int(values.get("accepted", 0)))


def open_engine(args, command: str) -> tuple[Engine, float] | None:
    """The engine for this command and its keep-alive, or None: --keep-alive 0, or the engine could not be
    started or reached (one line says why; the command then decodes in-process)."""
    keep_alive = parse_keep_alive(args.keep_alive)
    if keep_alive <= 0:
        return None
    try:
        return connect(keep_alive, notice=_notice), keep_alive
    except EngineUnavailable as e:
        _notice(f"refusion {command}: {e}; decoding in this process")
        return None


def load_model(engine: Engine, spec: dict, keep_alive: float, strategy: str, command: str) -> dict:
    """The engine's card of the model of `spec`, loading it (with one line saying so) when it is not resident."""
    status = engine.status() or {}
    if not any(model.get("spec") == spec for model in status.get("models", [])):
        _notice(f"refusion {command}: loading the model into the engine (a first load also builds its cache and "
                "native layers: a minute or two)")
    return engine.load(spec, keep_alive, strategy)


def generate(args, prompts: list[str], cfg: DecodeConfig, streamed: bool) -> int:
    """`refusion generate PROMPT...` through the engine. Returns how many prompts were answered: all of them, or
    fewer when the engine went away (the caller answers the rest in-process)."""
    from refusion.decode.cli import answer_header, stats_line

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
        _notice(f"refusion generate: {e}; decoding in this process")
        return 0
    if args.stats:
        print(f"[{card['setup']}]", flush=True)
    chat = not args.no_chat and card["chat_template"]
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            _write(answer_header(i, prompt) + "\n")
        path, body = request(prompt, cfg_body, chat=chat, system=args.system)
        try:
            result = answer(engine, path, body, spec, keep_alive, write=_write if streamed else None)
        except EngineDied as e:
            _write("\n" if streamed else "")
            _notice(f"refusion generate: {e}; answering again in this process")
            return i
        except EngineRefused as e:
            raise ValueError(str(e)) from None  # the engine refused the request: the same error in-process
        except EngineUnavailable as e:
            _notice(f"refusion generate: {e}; answering again in this process")
            return i
        _write("\n" if streamed else result.text + "\n")
        if args.stats and result.stats is not None:
            _write(stats_line(cfg, result.stats) + "\n")
    return len(prompts)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _notice(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class EngineChat:
    """`refusion chat` through the engine: the conversation is kept here and sent whole each turn (the engine's
    template renders it); a conversation that outgrows the context loses its oldest turns, as in-process. If the
    engine goes away, one line says so and the conversation goes on in this process (`in_process()`)."""

    def __init__(self, engine: Engine, spec: dict, keep_alive: float, cfg: DecodeConfig, *, system: str | None,
                 in_process: Callable[[], object], write=None, notice=None):
        from refusion.chat import Conversation

        self.engine, self.spec, self.keep_alive, self.cfg = engine, spec, keep_alive, cfg
        self.cfg_body = engine_settings(cfg)
        self.conversation = Conversation(system)
        self.write, self.notice = write or _write, notice or _notice
        self.last = None
        self._in_process, self.local = in_process, None
        self._shown = ""  # the text of the answer being written

    def ask(self, question: str):
        """Answer `question` after the conversation so far (as `chat.Chat.ask`)."""
        if self.local is not None:
            return self.local.ask(question)
        turns = self.conversation.turns
        turns.append({"role": "user", "content": question})
        try:
            answer = self._answer()
        except EngineRefused as e:
            self.notice(f"(error: {e})")
            answer = None
        except EngineUnavailable as e:
            turns.pop()
            self.notice(f"(the engine went away: {e}; answering in this process)")
            self.local = self._in_process()
            self.local.conversation, self.local.last = self.conversation, self.last
            return self.local.ask(question)
        if answer is None:
            turns.pop()
            return None
        turns.append({"role": "assistant", "content": answer.text})
        self.last = answer
        return answer

    def _answer(self):
        from refusion.chat import Answer
        from refusion.serve.translate import CONTEXT_LENGTH_EXCEEDED

        dropped = 0
        while True:
            body = {"model": "refusion", "stream": True, **self.cfg_body, "messages": self.conversation.messages}
            self._shown = ""
            try:
                result = answer(self.engine, "/v1/chat/completions", body, self.spec, self.keep_alive,
                                write=self._show)
            except EngineRefused as e:
                if e.code != CONTEXT_LENGTH_EXCEEDED:
                    raise
                if not self.conversation.drop_oldest_turn():
                    self.notice(f"(this message does not fit the model's context: {e})")
                    return None
                dropped += 1
                continue
            except KeyboardInterrupt:
                text = self._shown
                self.write("\n" if text else "")
                self.notice("(stopped)")
                return Answer([], text, None, stopped=True) if text else None
            break
        if dropped:
            self.notice(f"(the conversation outgrew the model's context: dropped its oldest "
                        f"{'turn' if dropped == 1 else f'{dropped} turns'})")
        self.write("\n")
        return Answer([], result.text, result.stats)

    def _show(self, piece: str) -> None:
        self._shown += piece
        self.write(piece)

    def stats_line(self) -> str:
        from refusion.chat import Chat

        return self.local.stats_line() if self.local is not None else Chat.stats_line(self)  # reads last and cfg

    def save(self, path: str) -> str:
        from refusion.chat import Chat

        return Chat.save(self, path)  # reads the conversation


def chat(args, cfg: DecodeConfig, in_process: Callable[[], object]) -> EngineChat | None:
    """The engine's side of `refusion chat`, or None (in-process: --keep-alive 0, settings only this process
    honours, or no engine to be had: one line says why)."""
    if engine_settings(cfg) is None:
        return None
    opened = open_engine(args, "chat")
    if opened is None:
        return None
    engine, keep_alive = opened
    spec = load_spec(args)
    try:
        card = load_model(engine, spec, keep_alive, cfg.strategy, "chat")
    except EngineRefused as e:
        raise ValueError(str(e)) from None
    except EngineUnavailable as e:
        _notice(f"refusion chat: {e}; decoding in this process")
        return None
    if not card["chat_template"]:
        raise ValueError("this model's tokenizer has no chat template: use `refusion generate --no-chat`")
    return EngineChat(engine, spec, keep_alive, cfg, system=args.system, in_process=in_process)
