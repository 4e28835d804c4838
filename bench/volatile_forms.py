"""Per-request values in forms the listed volatile patterns do not cover, put into real system prompts.

Two sets: DESIGN, the forms the learning was developed against (the issue's examples), and HELD_OUT,
written before the first benchmark run and never used to tune anything. Each form draws a fresh value
per request; a template puts four forms of one set into a real prompt: two header lines at the top
(the worst place for a prefix cache), one after the first sentence, one at the end.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable

Form = Callable[[random.Random], str]


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


DESIGN: dict[str, Form] = {
    "tier": lambda r: "Customer tier: " + r.choice(["GOLD", "SILVER", "BRONZE", "PLATINUM", "DIAMOND"]),
    "session": lambda r: f"session={_hex(r, 12)}",
    "weekday": lambda r: f"It's {r.choice(['Monday', 'Tuesday', 'Friday', 'Sunday'])} {r.randint(1, 12)}pm",
    "account": lambda r: f"Kontonummer {r.randint(1000, 999999)}",
    "user": lambda r: "user_name: " + r.choice(["alice", "bob", "carol", "dave", "erin", "frank"]),
    "upper_session_id": lambda r: f"SESSION-ID: {_hex(r, 8).upper()}",
}
HELD_OUT: dict[str, Form] = {
    "ticket": lambda r: f"Ticket #{r.choice(string.ascii_uppercase)}{r.randint(10000, 99999)}",
    "cart": lambda r: f"Cart total: EUR {r.randint(5, 900)}.{r.randint(0, 99):02d}",
    "weather": lambda r: (
        f"Weather where the user is: {r.randint(-5, 30)} C, "
        + r.choice(["sunny", "light rain", "overcast", "snow"])
    ),
    "login_as": lambda r: (
        "Angemeldet als: "
        + r.choice(["Anna Meier", "Jonas Keller", "Lea Fischer", "Noah Weber", "Mia Schmid"])
    ),
    "points": lambda r: f"Loyalty points balance = {r.randint(1000, 99999):,}",
    "ip": lambda r: (
        f"Last login {r.randint(2, 59)} minutes ago from "
        + ".".join(str(r.randint(1, 254)) for _ in range(4))
    ),
}
SETS = {"design": DESIGN, "held_out": HELD_OUT}


def template(prompt: str, forms: list[Form]) -> Callable[[random.Random], str]:
    """A real system prompt with four per-request values: a function drawing one request's prompt."""
    a, b, c, d = forms
    m = re.search(r"[.!?] ", prompt)
    cut = m.end() if m else len(prompt) // 2
    head, tail = prompt[:cut], prompt[cut:]
    return lambda r: f"{a(r)}\n{b(r)}\n\n{head}{c(r)}. {tail}\n{d(r)}"


def forms_for(which: str, k: int) -> tuple[list[str], list[Form]]:
    """The k-th template's four forms of a set (rotating, so every form is used)."""
    names = list(SETS[which])
    chosen = [names[(k * 4 + j) % len(names)] for j in range(4)]
    return chosen, [SETS[which][n] for n in chosen]
