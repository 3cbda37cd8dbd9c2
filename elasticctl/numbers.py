"""The one strict reading of a number written as text, for every number elasticctl takes from
a person or from untrusted text: flags, job files, ``--rdzv-conf``, the worker environment.

Python's ``int()`` and ``float()`` read more than anyone types on purpose: ``'1_5'`` is 15,
full-width and other scripts' digits are read as digits (``'１.５'`` is 1.5, ``'٨٠'`` is 80),
surrounding whitespace is skipped, ``'nan'`` and ``'inf'`` are numbers, and ``int()`` of a few
thousand digits raises a ValueError of its own. Each of those passed some validator while a
whole number next to it refused them. Here a number is written with the ASCII digits 0-9
only; the callers range-check what comes back and name the bad value in their own sentence.
"""

from __future__ import annotations

import math
import re

# 18 digits: every such number fits in 63 bits, and nothing elasticctl counts comes near.
_WHOLE_RE = re.compile(r"[0-9]{1,18}")
# Python's own bound on the digits int() converts (sys.int_info.str_digits_check_threshold's default).
_INTEGER_RE = re.compile(r"[-+]?[0-9]{1,4300}")
# A sign, digits with an optional fraction, and an optional exponent: what people write, and
# what str() of a float gives back ('1e-05', '1e+20'), which is how a YAML float arrives. str()
# writes up to 17 significant digits after up to 3 zeros ('0.0032208093663442087') before it
# turns to an exponent, so a fraction has room for 24.
_DECIMAL_RE = re.compile(r"[-+]?(?:[0-9]{1,18}(?:\.[0-9]{0,24})?|\.[0-9]{1,24})(?:[eE][-+]?[0-9]{1,3})?")


def whole_number(text: object) -> int | None:
    """``text`` as a whole number written with the ASCII digits 0-9 only (1 to 18 of them, no
    sign, no spaces), else None."""
    return int(text) if isinstance(text, str) and _WHOLE_RE.fullmatch(text) else None


def integer(text: object) -> int | None:
    """``text`` as an integer, signed or not, written with the ASCII digits 0-9, else None: for a
    check whose sentence names the range, which a number far out of it still gets."""
    return int(text) if isinstance(text, str) and _INTEGER_RE.fullmatch(text) else None


def decimal_number(text: object) -> float | None:
    """``text`` as a finite number written in ASCII (``1.5``, ``-3``, ``.5``, ``2e3``), else None."""
    if not isinstance(text, str) or not _DECIMAL_RE.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None
