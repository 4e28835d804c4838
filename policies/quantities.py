"""Numbers with units compared as values: "5 km" = "5 kilometres" = "5000 m", "5 km" != "5 miles".

The numbers guard compared digit strings, so "5000 m" / "5 km" (the same) was refused and "5 km" /
"5 miles" (not the same) passed. Units are read by ``pint``'s registry (offline, shipped with the
package); a quantity becomes its magnitude in base units plus those units, so any spelling of the same
amount gives the same key. Currencies, which pint does not know, are read from their symbols and codes.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

# number, then an optional scale word, then up to two words that may name a unit ("miles per hour")
_QUANTITY_RE = re.compile(
    r"(?P<cur>[$€£¥₹])?\s?(?P<num>\d+(?:[.,]\d+)*)\s?(?P<scale>(?-i:k)|thousand|million|billion|bn)?\b\s?"
    r"(?P<unit>°?[a-zµ°%][a-z°%²³]*(?:/[a-z]+)?(?:\s(?:per|an|a)\s[a-z]+)?)?",
    re.IGNORECASE,
)
_SCALES = {"k": 1e3, "thousand": 1e3, "million": 1e6, "billion": 1e9, "bn": 1e9}
_CURRENCY_SYMBOLS = {"$": "usd", "€": "eur", "£": "gbp", "¥": "jpy", "₹": "inr"}
_CURRENCY_WORDS = {
    "usd": "usd", "dollar": "usd", "dollars": "usd", "bucks": "usd", "eur": "eur", "euro": "eur",
    "euros": "eur", "gbp": "gbp", "inr": "inr", "rupee": "inr", "rupees": "inr", "rs": "inr",
    "yen": "jpy", "jpy": "jpy",
}  # fmt: skip
_SPELLED = {"per": "per", "an": "per", "a": "per"}
# English words pint also reads as units ("in" = inch, "at" = technical atmosphere, "are" = 100 m²):
# after a number they are almost always the sentence going on.
_NOT_UNITS = frozenset(
    """a an the in at are is as or and on to of by for it its am pm from with than per x each
    old more less about over under up down out off into
    us u pc it my me we be do go no so if he""".split()  # "2016 US", "a Windows 7 PC", "Win 10 it"
)
_ALIASES = {"°c": "degC", "°f": "degF", "°": "degree", "celsius": "degC", "fahrenheit": "degF"}


@lru_cache(maxsize=1)
def _registry() -> Any:
    import pint

    return pint.UnitRegistry(autoconvert_offset_to_baseunit=True)


def warm() -> None:
    """Load the unit registry now (about a second), not on the first query that names a unit."""
    _registry()
    _unit_name("km")


@lru_cache(maxsize=65536)
def _unit_name(unit: str) -> str | None:
    """The name pint knows a unit word by, or None when it is not one."""
    if unit.lower() in _NOT_UNITS or not unit:
        return None
    ureg = _registry()
    for name in dict.fromkeys((_ALIASES.get(unit.lower(), unit), unit.lower())):  # "GB" before "gb"
        try:
            ureg.Quantity(1.0, name).to_base_units()
        except Exception:  # pint raises several types for a non-unit word
            continue
        return name
    return None


def _base(value: float, name: str) -> str:
    """'<magnitude> <base units>'; converted per value because offset units (°C, °F) do not scale."""
    q = _registry().Quantity(value, name).to_base_units()
    return f"{_fmt(float(q.magnitude))} {q.units}"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _fmt(x: float) -> str:
    return f"{x:.6g}"


@lru_cache(maxsize=65536)
def quantities(text: str) -> tuple[tuple[str, str], ...]:
    """The numbers of a text that carry a unit, a currency or a scale word, as (the digits written, the
    amount: "5000 meter", "5 usd", "50000"), sorted. Units keep their case ("5 MB" is megabytes, "5 mb"
    millibarns); scale words and currencies do not."""
    found: list[str] = []
    used: list[str] = []
    for m in _QUANTITY_RE.finditer(text):
        raw = m.group("num")
        try:
            value = _number(raw) * _SCALES.get((m.group("scale") or "").lower(), 1.0)
        except ValueError:
            continue
        unit = (m.group("unit") or "").strip()
        words = unit.split()
        first = words[0].lower() if words else ""
        if m.group("cur"):
            found.append(f"{_fmt(value)} {_CURRENCY_SYMBOLS[m.group('cur')]}")
        elif first in _CURRENCY_WORDS:
            found.append(f"{_fmt(value)} {_CURRENCY_WORDS[first]}")
        else:
            name = None
            if len(words) == 3 and words[1].lower() in _SPELLED:  # "miles per hour"
                name = _unit_name(f"{words[0]}/{words[2]}")
            if name is None and words:
                name = _unit_name(words[0])
            if name is None:
                if m.group("scale"):
                    found.append(_fmt(value))
                    used.append(raw)
                continue
            found.append(_base(value, name))
        used.append(raw)
    return tuple(sorted(zip(used, found, strict=True)))
