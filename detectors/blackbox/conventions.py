"""What a loop declares about itself: the conventions a black-box detector may rely on, and nothing it guesses.

A correct loop may pad with any id, ignore any label value, compute its positions any way, and warm up for longer
than anyone watches it. A detector that assumed one convention (-100, an attribute called ``pad_id``, rotary
positions, a run as long as the watch) raised findings on such loops. So the conventions come from two places only:

- the tokenizer the loop hands to the watch, read through the tokenizer protocol every Hugging Face tokenizer keeps
  (``pad_token_id``, ``bos_token_id``, ``eos_token_id``, ``unk_token_id``);
- what the user declares: ``watch(..., declare={"positions": "relative", "total_steps": 1000})``. The HF callback
  declares ``total_steps`` from ``Trainer``'s ``max_steps``.

Anything neither gives is unknown (None), and a detector whose contract needs it says "not applicable" or reads
the loop's own behaviour instead (the loss's gradient shows which targets it ignores).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

POSITIONS = ("relative", "absolute")


@dataclass(frozen=True)
class Conventions:
    """``pad_id``/``bos_id``/``eos_id``/``unk_id``: the special token ids; ``positions``: "relative" (attention sees
    only offsets: rotary, ALiBi), "absolute" (a position's embedding is added) or None; ``total_steps``: the optimizer
    steps the run is planned to take (its schedule's length), None when not declared."""

    pad_id: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    positions: str | None = None
    total_steps: int | None = None

    @classmethod
    def of(cls, tokenizer=None, declare: dict | None = None) -> Conventions:
        """The tokenizer's special ids (its ``*_token_id``), overridden by ``declare``. Raises ValueError (one line)
        on an unknown key or a value of the wrong kind."""
        values = {f"{name}_id": _token_id(tokenizer, name) for name in ("pad", "bos", "eos", "unk")}
        for key, value in (declare or {}).items():
            if key not in _FIELDS:
                close = difflib.get_close_matches(key, _FIELDS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown convention {key!r}{hint}; known: {', '.join(_FIELDS)}")
            values[key] = _checked(key, value)
        return cls(**values)

    @property
    def special(self) -> dict[str, int]:
        """{"bos": id, "eos": id}: those the loop declared."""
        return {k: v for k, v in (("bos", self.bos_id), ("eos", self.eos_id)) if v is not None}

    def doubles_as_special(self, token: int) -> bool:
        """Whether ``token`` is also the EOS, BOS or UNK id (then a pad id may legitimately be attended)."""
        return token in (self.eos_id, self.bos_id, self.unk_id)


_FIELDS = tuple(f.name for f in fields(Conventions))


def _token_id(tokenizer, name: str) -> int | None:
    value = getattr(tokenizer, f"{name}_token_id", None) if tokenizer is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _checked(key: str, value):
    if value is None:
        return None
    if key == "positions":
        if value not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, not {value!r}")
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, not {value!r}")
    return value
