"""A labeled set of (response, reference answer, correct?) pairs for the math verifier."""

from __future__ import annotations

MATH_CASES: list[tuple[str, str, bool]] = [
    # integers, as the demo tokenizer decodes them (spaces between tokens)
    ("12 + 1 = 13 \\boxed{ 13 }", "13", True),
    ("\\boxed{ 13 }", "14", False),
    ("\\boxed{13}", "13", True),
    ("The answer is \\boxed{ 7 }.", "7", True),
    ("\\boxed{ 0 }", "0", True),
    ("\\boxed{ 100 }", "10", False),
    ("first \\boxed{ 3 } then corrected \\boxed{ 4 }", "4", True),
    ("first \\boxed{ 4 } then corrected \\boxed{ 3 }", "4", False),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{ 2 + 3 }", "5", True),
    # negative numbers
    ("\\boxed{ - 3 }", "-3", True),
    ("\\boxed{-3}", "-3", True),
    ("\\boxed{ 3 }", "-3", False),
    ("\\boxed{-12}", "12", False),
    ("\\boxed{ -0.5 }", "-\\frac{1}{2}", True),
    # fractions
    ("\\boxed{1/2}", "1/2", True),
    ("\\boxed{ 2/4 }", "1/2", True),
    ("\\boxed{1/3}", "1/2", False),
    ("\\boxed{3/4}", "0.75", True),
    ("\\boxed{7/2}", "3.5", True),
    ("\\boxed{2/3}", "0.66", False),
    # LaTeX fractions
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", True),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", True),
    ("\\boxed{\\frac{6}{8}}", "\\frac{3}{4}", True),
    ("\\boxed{\\frac{4}{3}}", "\\frac{3}{4}", False),
    ("\\boxed{-\\frac{2}{5}}", "-0.4", True),
    ("\\boxed{\\frac{2}{5}}", "-0.4", False),
    # decimals
    ("\\boxed{0.25}", "1/4", True),
    ("\\boxed{ 3.14 }", "3.14", True),
    ("\\boxed{3.15}", "3.14", False),
    ("\\boxed{2.50}", "2.5", True),
    ("\\boxed{2.0}", "2", True),
    ("\\boxed{0.1}", "0.01", False),
    # symbolic expressions
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{\\sqrt{2}}", "2^{1/2}", True),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", False),
    ("\\boxed{2\\pi}", "2\\pi", True),
    ("\\boxed{\\pi}", "3", False),
    # no box: no answer, even when the right number appears
    ("The final answer is 42", "42", False),
    ("The final answer is $\\frac{1}{4}$", "0.25", False),
    ("The final answer is 41", "42", False),
    # nothing usable
    ("I do not know", "5", False),
    ("\\boxed{}", "5", False),
    ("\\boxed{ 13", "13", False),
]
