"""A labeled set of (response, reference answer, correct?) pairs for the math verifier.

Labels come from reasoning about the mathematics (and, for the generated part, from exact
`fractions.Fraction` arithmetic), never from running the verifier. Pairs whose right label
depends on a convention the verifier does not share are left out and listed in docs/reward.md
(units are ignored, not converted: `5 m` vs `5 cm` would be accepted; `i^2` is not -1).
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction


def boxed(answer: str) -> str:
    return f"so the answer is \\boxed{{{answer}}}"


def _frac(value: Fraction) -> str:
    sign = "-" if value < 0 else ""
    value = abs(value)
    return f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"


def _decimal(value: Fraction) -> str:
    """Exact decimal of a fraction whose denominator has only the factors 2 and 5."""
    return format(Decimal(value.numerator) / Decimal(value.denominator), "f")


def _pmatrix(rows: list[list[int]]) -> str:
    return "\\begin{pmatrix} " + " \\\\ ".join(" & ".join(str(x) for x in row) for row in rows) + " \\end{pmatrix}"


HAND_CASES: list[tuple[str, str, bool]] = [
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

    # percentages (a percent is its hundredth)
    ("\\boxed{12.5\\%}", "0.125", True),
    ("\\boxed{12.5\\%}", "\\frac{1}{8}", True),
    ("\\boxed{33\\%}", "\\frac{1}{3}", False),
    ("\\boxed{100\\%}", "1", True),
    ("\\boxed{7\\%}", "0.07", True),
    ("\\boxed{7\\%}", "0.7", False),
    ("\\boxed{25\\%}", "50\\%", False),
    ("\\boxed{50\\%}", "50\\%", True),
    ("\\boxed{0.5}", "50\\%", True),
    # units and currency around the number (same unit as the reference)
    ("\\boxed{5 \\text{ cm}}", "5", True),
    ("\\boxed{6 \\text{ cm}}", "5", False),
    ("\\boxed{5\\,\\mathrm{m}}", "5", True),
    ("\\boxed{12\\text{ km/h}}", "12", True),
    ("\\boxed{3 \\text{ hours}}", "3", True),
    ("\\boxed{4\\text{ apples}}", "5", False),
    ("\\boxed{30^{\\circ}}", "30", True),
    ("\\boxed{45^\\circ}", "46^\\circ", False),
    ("\\boxed{\\$12.50}", "12.5", True),
    ("\\boxed{12.50 \\text{ dollars}}", "12.5", True),
    ("\\boxed{\\$13}", "12.5", False),
    # intervals
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", True),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3]", False),
    ("\\boxed{[0,1] \\cup [2,3]}", "[0,1]\\cup[2,3]", True),
    ("\\boxed{(-\\infty, 0) \\cup (0, \\infty)}", "(-\\infty,0)\\cup(0,\\infty)", True),
    ("\\boxed{(-\\infty, 0] \\cup (0, \\infty)}", "(-\\infty,0)\\cup(0,\\infty)", False),
    ("\\boxed{(0, \\infty)}", "(0,\\infty)", True),
    ("\\boxed{(\\frac{1}{2}, 2]}", "(0.5, 2]", True),
    ("\\boxed{x \\in [1,2]}", "[1,2]", True),
    # sets and lists of solutions
    ("\\boxed{\\{\\frac{1}{2}, 3\\}}", "\\{3, 0.5\\}", True),
    ("\\boxed{\\{a, b\\}}", "\\{b, a\\}", True),
    ("\\boxed{\\emptyset}", "\\emptyset", True),
    ("\\boxed{-1, 1}", "1, -1", True),
    ("\\boxed{x = 2, x = 3}", "2, 3", True),
    ("\\boxed{x=2 \\text{ or } x=3}", "2,3", True),
    ("\\boxed{(2, 1)}", "(1,2)", False),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    # matrices and vectors
    ("\\boxed{\\begin{bmatrix} 1/2 & 0 \\\\ 0 & 1 \\end{bmatrix}}",
     "\\begin{pmatrix} 0.5 & 0 \\\\ 0 & 1 \\end{pmatrix}", True),
    ("\\boxed{\\begin{bmatrix} 1 & 2 & 3 \\end{bmatrix}}", "\\begin{pmatrix} 1 & 2 & 3 \\end{pmatrix}", True),
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\\\ 3\\end{pmatrix}}", "\\begin{pmatrix} 1 & 2 & 3 \\end{pmatrix}", False),
    ("\\boxed{\\begin{pmatrix} \\frac{1}{2} \\\\ -1 \\end{pmatrix}}",
     "\\begin{pmatrix} 0.5 \\\\ -1 \\end{pmatrix}", True),
    ("\\boxed{\\begin{pmatrix} 2 \\\\ 4 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", False),
    # radicals, logarithms, combinatorics, complex numbers, constants
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{8}", False),
    ("\\boxed{\\ln 8}", "3\\ln 2", True),
    ("\\boxed{\\log_2 8}", "3", True),
    ("\\boxed{\\binom{5}{2}}", "10", True),
    ("\\boxed{5!}", "120", True),
    ("\\boxed{2+3i}", "3i+2", True),
    ("\\boxed{2-3i}", "2+3i", False),
    ("\\boxed{\\frac{22}{7}}", "\\pi", False),
    ("\\boxed{3.14}", "\\pi", False),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("\\boxed{\\infty}", "\\infty", True),
    ("\\boxed{-\\infty}", "\\infty", False),
    ("\\boxed{0.333}", "1/3", False),
    ("\\boxed{\\frac13}", "1/3", True),
    ("\\boxed{\\tfrac{1}{3}}", "1/3", True),
    ("\\boxed{1.5 \\times 10^{3}}", "1500", True),
    # algebra
    ("\\boxed{x^2 - 1}", "(x-1)(x+1)", True),
    ("\\boxed{(x-1)^2}", "x^2-1", False),
    ("\\boxed{\\frac{x}{2}}", "0.5x", True),
    ("\\boxed{2a+2b}", "2(a+b)", True),
    ("\\boxed{y = 2x+1}", "2x+1", True),
    ("\\boxed{x = 3}", "3", True),
    # multiple choice
    ("\\boxed{\\text{(B)}}", "B", True),
    ("\\boxed{\\textbf{(C)}}", "C", True),
    ("\\boxed{C}", "B", False),
]


def _fraction_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for p, q in [(1, 3), (2, 5), (3, 7), (5, 6), (7, 9), (4, 11), (9, 13), (11, 12)]:  # reduced, p != q
        reference = _frac(Fraction(p, q))
        cases += [
            (boxed(f"\\frac{{{2 * p}}}{{{2 * q}}}"), reference, True),   # same value, unreduced
            (boxed(f"{p}/{q}"), reference, True),
            (boxed(_frac(Fraction(q, p))), reference, False),           # reciprocal, p/q != 1
            (boxed(_frac(Fraction(p + 1, q))), reference, False),
        ]
    return cases


def _decimal_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for value in [Fraction(1, 4), Fraction(3, 8), Fraction(7, 20), Fraction(9, 25), Fraction(13, 40),
                  Fraction(5, 16), Fraction(3, 5), Fraction(17, 50)]:  # terminating decimals
        cases += [
            (boxed(_decimal(value)), _frac(value), True),
            (boxed(_frac(value)), _decimal(value), True),
            (boxed(_decimal(value + Fraction(1, 100))), _frac(value), False),
            (boxed(_decimal(-value)), _decimal(value), False),
        ]
    return cases


def _percent_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for percent in [Fraction(5), Fraction(25, 2), Fraction(20), Fraction(75, 2), Fraction(60), Fraction(80),
                    Fraction(150)]:
        reference = f"{_decimal(percent)}\\%"
        cases += [
            (boxed(_decimal(percent / 100)), reference, True),
            (boxed(_frac(percent / 100)), reference, True),
            (boxed(f"{_decimal(percent + 5)}\\%"), reference, False),
            (boxed(_decimal(percent / 10)), reference, False),  # neither p/100 nor p
        ]
    return cases


def _integer_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for n in [1234, 56789, 1000000, 20250, 987654]:
        grouped = f"{n:,}".replace(",", "{,}")
        cases += [(boxed(grouped), str(n), True), (boxed(str(n + 1)), str(n), False)]
    return cases


def _interval_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for a, b in [(-2, 5), (0, 1), (3, 10), (-7, -1), (1, 4)]:
        reference = f"[{a},{b}]"
        cases += [
            (boxed(f"[{a}, {b}]"), reference, True),
            (boxed(f"\\left[ {a}, {b} \\right]"), reference, True),
            (boxed(f"({a}, {b}]"), reference, False),  # the left end is excluded
            (boxed(f"[{a}, {b + 1}]"), reference, False),
        ]
    return cases


def _set_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for elements in [(1, 2, 3), (-1, 4, 9), (0, 5, 7), (2, 4, 6), (-3, 3, 8)]:
        reference = "\\{" + ", ".join(map(str, elements)) + "\\}"
        cases += [
            (boxed("\\{" + ", ".join(map(str, reversed(elements))) + "\\}"), reference, True),
            (boxed("\\{" + ", ".join(map(str, elements[:2])) + "\\}"), reference, False),
        ]
    return cases


def _matrix_cases() -> list[tuple[str, str, bool]]:
    cases = []
    for a, b, c, d in [(1, 2, 3, 4), (2, 0, 1, 2), (-1, 5, 0, 3), (4, -2, 7, 1), (0, 1, -1, 0)]:  # b != c
        rows = [[a, b], [c, d]]
        reference = _pmatrix(rows)
        halves = " \\\\ ".join(" & ".join(f"\\frac{{{2 * x}}}{{2}}" for x in row) for row in rows)
        cases += [
            (boxed(_pmatrix(rows)), reference, True),
            (boxed(f"\\begin{{bmatrix}} {halves} \\end{{bmatrix}}"), reference, True),
            (boxed(_pmatrix([[a, c], [b, d]])), reference, False),  # the transpose: not symmetric
            (boxed(_pmatrix([[2 * x for x in row] for row in rows])), reference, False),  # nonzero, doubled
        ]
    return cases


MATH_CASES: list[tuple[str, str, bool]] = (
    HAND_CASES + _fraction_cases() + _decimal_cases() + _percent_cases() + _integer_cases() + _interval_cases()
    + _set_cases() + _matrix_cases()
)
