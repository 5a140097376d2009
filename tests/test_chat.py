"""`refusion chat`: a conversation with one loaded model, answers streamed.

In the exact mode each answer equals AR decoding's, token for token, on every turn (the second turn's prompt holds
the first answer); the session survives bad input and Ctrl-C; the conversation drops its oldest turns when it
outgrows the model's context. The last test drives the command through a pseudo-terminal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from refusion.chat import NOT_TEXT, Chat, encode_messages, session
from refusion.config import DecodeConfig
from refusion.decode.loop import generate
from refusion.decode.stream import response_text
from refusion.model.tiny import tiny_model, tiny_tokenizer

EXACT = DecodeConfig(strategy="speculative", max_new_tokens=24, eos_token_id=0)  # eos 0 (pad): full-length answers
AR = EXACT.for_strategy("autoregressive")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model(), tiny_tokenizer()


class Recorder:
    """What a chat wrote (answers, in pieces) and noticed (one line each)."""

    def __init__(self):
        self.writes, self.notices = [], []

    def chat(self, model, tokenizer, cfg, **kwargs) -> Chat:
        return Chat(model, tokenizer, cfg, write=self.writes.append, notice=self.notices.append, **kwargs)


def ar_answer(model, tokenizer, messages) -> list[int]:
    return generate(model, [encode_messages(tokenizer, messages)], AR).sequences[0]


@pytest.mark.parametrize("system", [None, "be brief"])
def test_exact_mode_answers_equal_ar_decoding_on_every_turn(model_and_tokenizer, system):
    model, tokenizer = model_and_tokenizer
    out = Recorder()
    chat = out.chat(model, tokenizer, EXACT, system=system)
    sent = ([{"role": "system", "content": system}] if system else [])
    for question in ("hello there", "and then?", "why?"):
        sent.append({"role": "user", "content": question})
        expected = ar_answer(model, tokenizer, sent)  # the prompt holds every earlier answer
        written = len(out.writes)
        answer = chat.ask(question)
        assert answer.tokens == expected and answer.text == response_text(tokenizer, expected)
        assert "".join(out.writes[written:]) == answer.text + "\n"
        assert len(out.writes) - written > 2  # streamed in pieces, not written whole
        sent.append({"role": "assistant", "content": answer.text})
    assert chat.conversation.messages == sent
    assert chat.stats_line().startswith("[speculative | tokens 24 |")


def test_commands_and_bad_input_get_one_line_and_the_session_goes_on(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    out = Recorder()
    chat = out.chat(model, tokenizer, EXACT, system="be brief")
    saved = tmp_path / "conversation.json"
    lines = iter(["/stats", "", "   ", "/frobnicate", "/save", f"/save {tmp_path}/missing/x.json", f"/save {tmp_path}",
                  "hello there", "/stats", f"/save {saved}", "/reset", "/stats", "/help", "/exit", "never read"])
    session(chat, read=lambda prompt: next(lines))
    assert next(lines) == "never read"  # /exit left the session
    assert out.notices[:7] == [
        "(no answer yet)", "(empty message: type a question, or /help)", "(empty message: type a question, or /help)",
        "(unknown command /frobnicate: /help lists them)", "(usage: /save FILE)",
        f"(cannot write {tmp_path}/missing/x.json: No such file or directory)", f"(cannot write {tmp_path}: Is a directory)"]
    assert out.notices[7].startswith("[speculative | tokens 24 |") and out.notices[8] == f"(saved 3 messages to {saved})"
    assert out.notices[9:11] == ["(the conversation starts afresh)", "(no answer yet)"]
    assert "/save FILE" in out.notices[11] and len(out.notices) == 12
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant"] and messages[1]["content"] == "hello there"
    assert chat.conversation.messages == [{"role": "system", "content": "be brief"}]


def test_a_line_that_is_not_utf8_gets_one_line_and_the_session_goes_on(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    out = Recorder()
    chat = out.chat(model, tokenizer, EXACT)
    undecodable = b"\xff\xfe".decode("utf-8", "surrogateescape")  # what Python's stdin makes of those bytes

    def strict(prompt):  # a stdin that decodes strictly
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    reads = iter([lambda p: undecodable, strict, lambda p: "hello", lambda p: "/exit"])
    session(chat, read=lambda prompt: next(reads)(prompt))
    assert out.notices == [NOT_TEXT, NOT_TEXT]
    assert [m["content"] for m in chat.conversation.messages][:1] == ["hello"] and out.writes  # then it answered


def test_bytes_that_are_not_utf8_on_stdin_are_one_line_not_a_traceback(tiny_model_dir):
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), REFUSION_NATIVE="0")
    done = subprocess.run([sys.executable, "-m", "refusion", "chat", "--model", tiny_model_dir, "--dtype", "float32",
                           "--max-new-tokens", "4", "--strategy", "autoregressive"],
                          input=b"\xff\xfe\nhello\n", capture_output=True, env=env, timeout=300)
    err = done.stderr.decode()
    assert done.returncode == 0 and "Traceback" not in err, err
    assert err.strip().splitlines() == [NOT_TEXT]
    assert done.stdout  # "hello" was answered after it


def test_end_of_input_leaves(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer

    def read(prompt):
        raise EOFError
    session(Recorder().chat(model, tokenizer, EXACT), read=read)  # returns: Ctrl-D leaves


def test_ctrl_c_stops_the_answer_and_keeps_what_was_shown(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    out = Recorder()
    chat = out.chat(model, tokenizer, EXACT)

    def write(text):  # Ctrl-C arrives while the third piece of the answer is written
        out.writes.append(text)
        if len(out.writes) == 3:
            raise KeyboardInterrupt
    chat.write = write
    answer = chat.ask("hello there")
    shown = "".join(out.writes[:3])
    assert answer.stopped and answer.text == shown and 0 < len(shown) < 24
    assert out.notices == ["(stopped)"] and chat.stats_line() == "(the last answer was stopped: no statistics)"
    assert chat.conversation.messages[-1] == {"role": "assistant", "content": shown}
    chat.write = out.writes.append
    second = chat.ask("go on")  # the session goes on, the stopped answer in the prompt
    sent = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": shown},
            {"role": "user", "content": "go on"}]
    assert second.tokens == ar_answer(model, tokenizer, sent) and not second.stopped


def test_the_oldest_turns_leave_when_the_conversation_outgrows_the_context():
    model, tokenizer = tiny_model(max_positions=128), tiny_tokenizer()
    out = Recorder()
    chat = out.chat(model, tokenizer, EXACT, system="be brief")
    lengths = []
    for question in ("first question here", "second question here", "third question here"):
        assert chat.ask(question) is not None
        lengths.append(len(encode_messages(tokenizer, chat.conversation.messages[:-1])))
    # each turn adds ~60 tokens (question, answer, template) to a context of 128, 24 of them for the answer
    assert out.notices == ["(the conversation outgrew the model's context: dropped its oldest turn)"] * 2
    assert [m["content"] for m in chat.conversation.messages if m["role"] == "user"] == ["third question here"]
    assert max(lengths) + EXACT.max_new_tokens <= 128
    messages = list(chat.conversation.messages)
    assert chat.ask("x" * 120) is None  # alone too long: one line, the conversation unchanged
    assert out.notices[-1].startswith("(this message does not fit the model's context: (")
    assert chat.conversation.messages == messages


def test_a_model_without_a_chat_template_is_refused(model_and_tokenizer):
    model, _ = model_and_tokenizer
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Chat(model, tokenizer, EXACT)


def test_chat_through_a_terminal(tiny_model_dir, tmp_path):
    """The command in a pseudo-terminal: an answer streams and equals AR decoding's text; commands; Ctrl-C
    stops a long answer (whose turn first drops the oldest one) and at the prompt; Ctrl-D leaves."""
    pexpect = pytest.importorskip("pexpect")
    src = str(Path(__file__).resolve().parents[1] / "src")
    # the Python layer loop (same tokens): a child closed by force never leaves the native build's lock behind
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), TERM="dumb",
               REFUSION_NATIVE="0")
    new_tokens = 500  # each answer is 500 tokens (EOS is the pad id): a second turn outgrows the 1024 positions
    child = pexpect.spawn(sys.executable, ["-m", "refusion", "chat", "--model", tiny_model_dir, "--dtype", "float32",
                                           "--strategy", "speculative", "--max-new-tokens", str(new_tokens),
                                           "--eos-token-id", "0", "--system", "be brief"],
                          env=env, encoding="utf-8", timeout=180)
    try:
        child.expect_exact(">>> ")
        child.sendline("hello there")
        child.expect_exact("hello there\r\n")
        child.expect_exact("\r\n>>> ", timeout=60)
        model, tokenizer = tiny_model(), tiny_tokenizer()
        cfg = AR.for_strategy("autoregressive")
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
        expected = generate(model, [encode_messages(tokenizer, messages)], cfg, max_new_tokens=new_tokens).sequences[0]
        assert child.before.replace("\r\n", "\n") == response_text(tokenizer, expected)

        child.sendline("/stats")
        child.expect(r"\[speculative \| tokens 500 \|.*\]\r\n>>> ")
        for line, reply in [("/nope", "(unknown command /nope: /help lists them)"),
                            ("", "(empty message: type a question, or /help)"),
                            ("/save /nonexistent-dir/c.json", "(cannot write /nonexistent-dir/c.json: ")]:
            child.sendline(line)
            child.expect_exact(reply)
            child.expect_exact(">>> ")

        child.sendline("tell me more")
        child.expect_exact("dropped its oldest turn)")
        child.expect(r"\r\n[^\r\n]")  # the answer has begun
        child.sendintr()
        child.expect_exact("(stopped)", timeout=60)
        child.expect_exact(">>> ")
        child.sendintr()  # at the prompt
        child.expect_exact("(Ctrl-D or /exit leaves)")
        saved = tmp_path / "c.json"
        child.sendline(f"/save {saved}")
        child.expect_exact("(saved 3 messages to")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    messages = json.loads(saved.read_text())
    assert [m["content"] for m in messages[:2]] == ["be brief", "tell me more"]
    assert 0 < len(messages[2]["content"]) < new_tokens and not re.search("\ufffd", messages[2]["content"])
