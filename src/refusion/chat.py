"""`refusion chat`: a conversation with one loaded model, each answer streamed as it is committed.

The conversation is a list of chat messages (an optional system message, then user and assistant turns). Each
question re-encodes the whole conversation through the model's chat template and decodes it with `generate`, the
settings built from the same flags as `refusion generate`; the answer's committed text is written as it grows
(`decode/stream.py`). When the conversation no longer fits the model's context, its oldest turns are dropped (one
line says so). Ctrl-C stops the answer being written (the conversation keeps what was shown) and Ctrl-D leaves.

Commands: /reset, /stats, /save FILE, /help, /exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from refusion.arguments import (
    add_decode_arguments,
    add_model_arguments,
    check_text,
    decode_config_from_args,
    is_text,
    load_from_args,
)
from refusion.config import CONTEXT_LENGTH_EXCEEDED
from refusion.engine.answers import (
    add_keep_alive_argument,
    answer,
    engine_settings,
    load_model,
    notice,
    open_engine,
)
from refusion.engine.client import EngineRefused, EngineUnavailable, load_spec

if TYPE_CHECKING:
    from refusion.decode.outputs import SequenceStats

PROMPT = ">>> "
NOT_TEXT = "(that line is not UTF-8 text: check the terminal's encoding and type it again)"
HELP = ("/reset forgets the conversation, /stats shows the last answer's statistics, /save FILE writes the "
        "conversation as JSON messages, /exit (or Ctrl-D) leaves; Ctrl-C stops an answer")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="talk to a model: a multi-turn conversation, answers streamed",
                              description="A conversation with one loaded model through its chat template; each "
                                          f"answer is written as it is committed. In the session: {HELP}.")
    add_model_arguments(p)
    add_keep_alive_argument(p)
    add_decode_arguments(p)
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.set_defaults(func=run)


@dataclass
class Answer:
    """One answer of the conversation."""

    tokens: list[int]
    """Its token ids (up to and including EOS); those committed before Ctrl-C when stopped."""
    text: str
    """Its text, as written."""
    stats: SequenceStats | None
    """The sequence's `SequenceStats` (None when stopped)."""
    stopped: bool = False
    """Whether Ctrl-C stopped it."""


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids of a conversation: its messages through the chat template, the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


class Conversation:
    """The messages of a chat: the system message (if any) first, then user and assistant turns."""

    def __init__(self, system: str | None = None):
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []

    @property
    def messages(self) -> list[dict]:
        return self.system + self.turns

    def drop_oldest_turn(self) -> bool:
        """Forget the oldest question and its answer; False when only the newest question is left."""
        if len(self.turns) <= 1:
            return False
        del self.turns[:2]
        return True

    def reset(self) -> None:
        self.turns.clear()


class Chat:
    """One loaded model answering a conversation, each answer written to `write` as it is committed."""

    def __init__(self, model, tokenizer, cfg, *, system: str | None = None,
                 write: Callable[[str], object] | None = None, notice: Callable[[str], object] | None = None):
        """`write`: where answers go (default: stdout, flushed); `notice`: where one-line notices go (stderr)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use `refusion generate --no-chat`")
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.conversation = Conversation(system)
        self.write = write or _write_stdout
        self.notice = notice or _notice_stderr
        self.last: Answer | None = None

    def ask(self, question: str) -> Answer | None:
        """Answer `question` after the conversation so far, writing the answer as it is committed. None when no
        answer was made: the question alone does not fit the model's context, decoding refused the settings, or
        Ctrl-C came before any text (a notice says which; the question is forgotten)."""
        turns = self.conversation.turns
        turns.append({"role": "user", "content": question})
        answer = None
        try:
            prompt = self.fitting_prompt()
            if prompt is not None:
                answer = self.answer(prompt)
        except ValueError as e:  # e.g. a setting this model cannot decode with
            self.notice(f"(error: {e})")
        except KeyboardInterrupt:  # Ctrl-C before decoding began
            self.notice("(stopped)")
        return end_turn(self, answer)

    def answer(self, prompt: list[int]) -> Answer | None:
        """Decode `prompt`, writing the answer as it is committed, then a newline. Ctrl-C ends the answer with the
        text shown (None when none was)."""
        from refusion.decode.loop import generate
        from refusion.decode.stream import ResponseStream

        stream, seqs = ResponseStream(self.tokenizer, self.write), []

        def on_round(seq, rnd) -> None:
            seqs[:] = [seq]
            stream.update(seq.contiguous_response())
        try:
            out = generate(self.model, [prompt], self.cfg, on_round=on_round)
        except KeyboardInterrupt:
            self.write("\n" if stream.written else "")
            self.notice("(stopped)")
            if not stream.written:
                return None
            return Answer(seqs[0].contiguous_response(), stream.written, None, stopped=True)
        except ValueError:
            self.write("\n" if stream.written else "")
            raise
        text = stream.finish(out.sequences[0])
        self.write("\n")
        return Answer(out.sequences[0], text, out.stats.per_sequence[0])

    def fitting_prompt(self) -> list[int] | None:
        """The prompt ids of the conversation, its oldest turns dropped (with a notice) until it fits the model's
        context; None (with a notice, nothing dropped) when the newest question alone does not fit."""
        newest = self.conversation.system + self.conversation.turns[-1:]
        too_long = self.too_long(encode_messages(self.tokenizer, newest))
        if too_long is not None:
            self.notice(f"(this message does not fit the model's context: {too_long})")
            return None
        dropped = 0
        while self.too_long(prompt := encode_messages(self.tokenizer, self.conversation.messages)) is not None:
            if not self.conversation.drop_oldest_turn():
                break  # not reached: the newest question alone fits
            dropped += 1
        if dropped:
            self.notice(dropped_notice(dropped))
        return prompt

    def too_long(self, prompt: list[int]) -> str | None:
        """Why `prompt` and the answer's tokens do not fit the model's context, or None when they do."""
        from refusion.decode.loop import PromptTooLong, validate_prompts

        try:
            validate_prompts(self.model, [prompt], self.cfg, None)
        except PromptTooLong as e:
            return str(e).removeprefix("prompt 0 ")  # a chat has one prompt
        return None

    def stats_line(self) -> str:
        from refusion.decode.cli import stats_line

        if self.last is None:
            return "(no answer yet)"
        if self.last.stats is None:
            return "(the last answer was stopped: no statistics)"
        return stats_line(self.cfg, self.last.stats)

    def save(self, path: str) -> str:
        """Write the conversation as a JSON list of messages; the one line that says what happened."""
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(self.conversation.messages, f, ensure_ascii=False, indent=1)
                f.write("\n")
        except OSError as e:
            return f"(cannot write {path}: {e.strerror or e})"
        return f"(saved {len(self.conversation.messages)} messages to {path})"


def end_turn(chat, answer: Answer | None) -> Answer | None:
    """Close the turn a question opened: the answer joins the conversation (and is the last one), or, when there is
    none, the question is forgotten."""
    if answer is None:
        chat.conversation.turns.pop()
        return None
    chat.conversation.turns.append({"role": "assistant", "content": answer.text})
    chat.last = answer
    return answer


def dropped_notice(dropped: int) -> str:
    """The line that says how many of the oldest turns were dropped to fit the context."""
    return (f"(the conversation outgrew the model's context: dropped its oldest "
            f"{'turn' if dropped == 1 else f'{dropped} turns'})")


def handle_command(chat: Chat, line: str) -> bool:
    """Run one slash command; False when it ends the session. Bad commands get one line."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name == "/exit":
        return False
    if name == "/reset":
        chat.conversation.reset()
        chat.last = None
        chat.notice("(the conversation starts afresh)")
    elif name == "/stats":
        chat.notice(chat.stats_line())
    elif name == "/save":
        chat.notice(chat.save(os.path.expanduser(rest)) if rest else "(usage: /save FILE)")
    elif name == "/help":
        chat.notice(HELP)
    else:
        chat.notice(f"(unknown command {name}: /help lists them)")
    return True


def session(chat: Chat, read: Callable[[str], str] = input, prompt: str = PROMPT) -> None:
    """Read lines until /exit or end of input: a slash command runs, any other text is a question answered."""
    while True:
        try:
            line = read(prompt).strip()
        except EOFError:  # Ctrl-D
            chat.write("\n")
            return
        except UnicodeDecodeError:  # a strict stdin: the line is lost, the session goes on
            chat.notice(NOT_TEXT)
            continue
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, the session goes on
            chat.write("\n")
            chat.notice("(Ctrl-D or /exit leaves)")
            continue
        if not line:
            chat.notice("(empty message: type a question, or /help)")
        elif not is_text(line):
            chat.notice(NOT_TEXT)
        elif line.startswith("/"):
            if not handle_command(chat, line):
                return
        else:
            chat.ask(line)


def enable_line_editing() -> None:
    """Arrow keys, editing and history at the prompt, where Python has readline (importing it is enough)."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401


def run(args: argparse.Namespace) -> int:
    cfg = decode_config_from_args(args)  # validated before the model loads
    check_text(args.system, "--system")

    def in_process() -> Chat:
        model, tokenizer = load_from_args(args)
        return Chat(model, tokenizer, cfg, system=args.system)

    chat = engine_chat(args, cfg, in_process) or in_process()
    interactive = sys.stdin.isatty()
    if interactive:
        enable_line_editing()
        chat.notice(f"refusion chat ({args.model or 'the embedded model'}, strategy {cfg.strategy}): {HELP}")
    session(chat, prompt=PROMPT if interactive else "")
    return 0


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _notice_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ through the resident engine
class EngineChat:
    """`refusion chat` through the engine: the conversation is kept here and sent whole each turn (the engine's
    template renders it); a conversation that outgrows the context loses its oldest turns, as in-process. If the
    engine goes away, one line says so and the conversation goes on in this process (`in_process()`)."""

    def __init__(self, engine, spec: dict, keep_alive: float, cfg, *, system: str | None,
                 in_process: Callable[[], object], write=None, notice=None):
        self.engine, self.spec, self.keep_alive, self.cfg = engine, spec, keep_alive, cfg
        self.cfg_body = engine_settings(cfg)
        self.conversation = Conversation(system)
        self.write, self.notice = write or _write_stdout, notice or _notice_stderr
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
        return end_turn(self, answer)

    def _answer(self):
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
            self.notice(dropped_notice(dropped))
        self.write("\n")
        return Answer([], result.text, result.stats)

    def _show(self, piece: str) -> None:
        self._shown += piece
        self.write(piece)

    def stats_line(self) -> str:
        return self.local.stats_line() if self.local is not None else Chat.stats_line(self)  # reads last and cfg

    def save(self, path: str) -> str:
        return Chat.save(self, path)  # reads the conversation


def engine_chat(args, cfg, in_process: Callable[[], object]) -> EngineChat | None:
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
        notice(f"refusion chat: {e}; decoding in this process")
        return None
    if not card["chat_template"]:
        raise ValueError("this model's tokenizer has no chat template: use `refusion generate --no-chat`")
    return EngineChat(engine, spec, keep_alive, cfg, system=args.system, in_process=in_process)
