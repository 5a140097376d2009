"""Answer extraction and scoring: GSM8K final number, MATH boxed answer, choice letters, code blocks.

Pure string functions, no model and no I/O: each takes a model response and returns what the task
compares against its reference. Code is scored by running it (see `sandbox.py`), not here.
"""

from __future__ import annotations

import re

# ---------------------------------------------------------------------------------------------------
# numbers (GSM8K)

_NUMBER = re.compile(r"-?[$]?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def parse_number(text: str) -> float | None:
    """The value of a number written like "1,234", "$5", "-3.50", "7." (None if it is not one)."""
    text = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    text = re.sub(r"^\\?\$|\\%$|%$", "", text)
    frac = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", text)
    if frac:
        return int(frac.group(1)) / int(frac.group(2)) if int(frac.group(2)) else None
    try:
        return float(text)
    except ValueError:
        return None


def extract_gsm8k_reference(answer: str) -> float:
    """GSM8K's gold answer: the number after '####'."""
    value = parse_number(answer.split("####")[-1])
    if value is None:
        raise ValueError(f"GSM8K answer has no number after '####': {answer[-60:]!r}")
    return value


def extract_final_number(response: str) -> float | None:
    """A model's final numeric answer, looked for in this order: the last \\boxed{...} holding a number,
    '#### N', 'answer is N' / 'answer: N', then the last number of the response."""
    boxed = last_boxed(response)
    if boxed is not None:
        value = parse_number(_strip_text_wrappers(boxed))
        if value is None:  # "\boxed{18 \text{ dollars}}", "\boxed{x = 4}"
            numbers = _NUMBER.findall(boxed)
            value = parse_number(numbers[-1]) if numbers else None
        if value is not None:
            return value
    for pattern in (r"####\s*(.+)", r"[Aa]nswer(?: is|:)\s*:?\s*(.+)"):
        matches = re.findall(pattern, response)
        if matches:
            numbers = _NUMBER.findall(matches[-1])
            if numbers:
                return parse_number(numbers[0])
    numbers = _NUMBER.findall(response)
    return parse_number(numbers[-1]) if numbers else None


def numbers_equal(a: float | None, b: float | None, rel_tol: float = 1e-6) -> bool:
    if a is None or b is None:
        return False
    return abs(a - b) <= rel_tol * max(1.0, abs(a), abs(b))


# ---------------------------------------------------------------------------------------------------
# boxed answers and MATH normalisation (Hendrycks et al. 2021, `is_equiv` / `strip_string`)

def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or '\\boxed 5'), braces balanced; None if absent."""
    starts = [m.start() for m in re.finditer(r"\\boxed|\\fbox", text)]
    if not starts:
        return None
    i = starts[-1]
    rest = text[i:]
    head = re.match(r"\\(?:boxed|fbox)\s*", rest)
    j = head.end()
    if j < len(rest) and rest[j] != "{":  # "\boxed 5"
        m = re.match(r"[^\s$]+", rest[j:])
        return m.group(0) if m else None
    depth = 0
    for k in range(j, len(rest)):
        if rest[k] == "{":
            depth += 1
        elif rest[k] == "}":
            depth -= 1
            if depth == 0:
                return rest[j + 1:k]
    return None  # unbalanced: the response was cut off inside the box


def _strip_text_wrappers(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s).strip()


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_slash(s: str) -> str:
    """'3/4' -> \\frac{3}{4} when both sides are integers."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    """\\sqrt3 -> \\sqrt{3}."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_math_answer(s: str) -> str:
    """Canonical form of a MATH answer, following the reference `strip_string` of the MATH repository."""
    s = s.strip().replace("\n", "").replace("\\!", "")
    s = re.sub(r"\\+", r"\\", s)  # "\\frac" -> "\frac"
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"^(.*?\S)\s*\\text\{\s*[a-zA-Z ]*\}$", r"\1", s).strip()  # trailing units: "5 \text{ cm}"
    s = _strip_text_wrappers(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if re.match(r"^[a-zA-Z]\s*=", s) and len(s.split("=")[0]) <= 2:  # "x = 5" -> "5"
        s = s.split("=", 1)[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_slash(s)
    s = s.rstrip(".")
    return s


def math_equal(prediction: str | None, reference: str) -> bool:
    """Whether two MATH answers agree after normalisation (or as numbers, when both are numbers)."""
    if prediction is None:
        return False
    a, b = normalize_math_answer(prediction), normalize_math_answer(reference)
    if not a:
        return False
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and numbers_equal(x, y)


def extract_math_answer(response: str) -> str | None:
    """The model's MATH answer: the last \\boxed{...}, else what follows 'answer is'."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    m = re.findall(r"[Ff]inal answer(?: is|:)\s*:?\s*\$?([^\n$]+)\$?", response)
    m = m or re.findall(r"[Aa]nswer is\s*:?\s*\$?([^\n$]+)\$?", response)
    return m[-1].strip().rstrip(".") if m else None


# ---------------------------------------------------------------------------------------------------
# multiple choice (ARC-Challenge, MMLU-Pro)

def extract_choice(response: str, letters: str) -> str | None:
    """The chosen option letter among `letters` ("ABCD", "ABCDEFGHIJ"): 'answer is (X)', 'Answer: X',
    \\boxed{X}, a response that is just the letter, then the last standalone letter (MMLU-Pro's order)."""
    cls = f"[{letters}]"
    patterns = [
        rf"answer is:?\s*\(?\**\s*({cls})\b",
        rf"[Aa]nswer\**\s*:\**\s*\(?\**({cls})\b",
        rf"\\boxed\{{\s*(?:\\text\{{)?\(?({cls})\b",
    ]
    for pattern in patterns:
        found = re.findall(pattern, response, flags=re.IGNORECASE if pattern.startswith("answer") else 0)
        if found:
            return found[-1].upper()
    bare = re.fullmatch(rf"\s*\(?({cls})\)?[.:]?\s*", response)
    if bare:
        return bare.group(1)
    standalone = re.findall(rf"(?<![A-Za-z'])\(?({cls})\)(?![A-Za-z])|(?<![A-Za-z'])({cls})(?=[.:]?(?:\s|$))",
                            response)
    letters_found = [a or b for a, b in standalone if (a or b) != "A" or _a_is_choice(response)]
    return letters_found[-1] if letters_found else None


def _a_is_choice(response: str) -> bool:
    """'A' is also an English article: count a bare A only if it is written like a choice."""
    return re.search(r"(?<![A-Za-z])\(A\)|(?<![A-Za-z])A[.:)](?:\s|$)|(?<![A-Za-z])A$", response) is not None


# ---------------------------------------------------------------------------------------------------
# code

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(response: str) -> str:
    """The program in a response: the fenced ```python blocks (the longest if several, and all blocks that
    define the function are preferred over usage examples); the whole response when it has no fence."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(response)]
    if not blocks:
        return response.strip("\n")
    python = [body for lang, body in blocks if lang in ("python", "py", "python3", "")] or [b for _, b in blocks]
    defining = [b for b in python if re.search(r"^\s*(def|class|import|from)\s", b, re.MULTILINE)]
    return max(defining or python, key=len).strip("\n")


def defines_function(code: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None
