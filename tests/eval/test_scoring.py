"""Answer extraction and normalisation on real response shapes."""

import pytest

from refusion.eval import scoring


@pytest.mark.parametrize("response, expected", [
    ("She sells 9 eggs, so she makes 9 * 2 = $18.\n\\boxed{18}", 18),
    ("... so the total is \\boxed{\\$1,250.50}", 1250.5),
    ("\\boxed{18 \\text{ dollars}}", 18),
    ("Step 1: 3 + 4 = 7\n#### 42", 42),
    ("The answer is: 1,000 apples. Check: 10 x 100", 1000),
    ("first 12, then 7, finally -3.5", -3.5),
    ("\\boxed{\\frac{3}{4}}", 0.75),
    ("no digits here", None),
])
def test_final_number(response, expected):
    value = scoring.extract_final_number(response)
    assert (value is None) if expected is None else scoring.numbers_equal(value, expected)


def test_gsm8k_reference_and_comparison():
    assert scoring.extract_gsm8k_reference("so 9*2=<<9*2=18>>18\n#### 18") == 18
    assert scoring.numbers_equal(18.0, 18)
    assert not scoring.numbers_equal(18.0, 18.5)
    assert not scoring.numbers_equal(None, 18)
    with pytest.raises(ValueError):
        scoring.extract_gsm8k_reference("no final answer")


@pytest.mark.parametrize("text, expected", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed 5", "5"),
    ("\\fbox{x^{2}}", "x^{2}"),
    ("cut off \\boxed{\\frac{1}{2", None),
    ("nothing boxed", None),
])
def test_last_boxed(text, expected):
    assert scoring.last_boxed(text) == expected


@pytest.mark.parametrize("prediction, reference", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("0.5", "\\frac12"),
    ("1/2", "\\frac{1}{2}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("(3,\\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("90^\\circ", "90"),
    ("x = 5", "5"),
    ("10\\%", "10"),
    ("\\$18", "18"),
    ("5 \\text{ cm}", "5"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("2.50", "2.5"),
    ("\\text{(C)}", "(C)"),
])
def test_math_equal(prediction, reference):
    assert scoring.math_equal(prediction, reference)


@pytest.mark.parametrize("prediction, reference", [
    ("\\frac{1}{3}", "\\frac{1}{2}"),
    ("(3,\\pi)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("2", "-2"),
    (None, "1"),
])
def test_math_not_equal(prediction, reference):
    assert not scoring.math_equal(prediction, reference)


def test_extract_math_answer():
    assert scoring.extract_math_answer("thus $\\boxed{\\dfrac{9}{7}}$.") == "\\dfrac{9}{7}"
    assert scoring.extract_math_answer("The final answer is $\\frac{1}{2}$") == "\\frac{1}{2}"
    assert scoring.extract_math_answer("I am not sure") is None


@pytest.mark.parametrize("response, letters, expected", [
    ("Days become shorter. The answer is C", "ABCD", "C"),
    ("... therefore the answer is (J).", "ABCDEFGHIJ", "J"),
    ("Answer: B", "ABCD", "B"),
    ("**Answer:** D", "ABCD", "D"),
    ("\\boxed{E}", "ABCDE", "E"),
    ("B", "ABCD", "B"),
    ("(C)", "ABCD", "C"),
    ("A is wrong because ... so I pick D.", "ABCD", "D"),
    ("It is a planet with a day. C.", "ABCD", "C"),
    ("The answer is E", "ABCD", None),  # not an option of this question
    ("I cannot tell.", "ABCD", None),
])
def test_extract_choice(response, letters, expected):
    assert scoring.extract_choice(response, letters) == expected


def test_extract_code():
    response = ("Here is the solution:\n```python\ndef add(a, b):\n    return a + b\n```\n"
                "Example:\n```python\nprint(add(1, 2))\n```")
    assert scoring.extract_code(response) == "def add(a, b):\n    return a + b"
    assert scoring.extract_code("def f():\n    return 1\n") == "def f():\n    return 1"
    unterminated = "```python\ndef f():\n    return 1\n"
    assert scoring.extract_code(unterminated).startswith("def f():")
    assert scoring.defines_function("x = 1\ndef  f (a):\n  pass", "f")
    assert not scoring.defines_function("def ff(a): pass", "f")


def test_text_answers_are_not_emptied():
    assert not scoring.math_equal("\\text{no idea}", "\\text{Evelyn}")
    assert scoring.math_equal("\\text{Evelyn}", "\\text{Evelyn}")
    assert not scoring.math_equal("", "")
