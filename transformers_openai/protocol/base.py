"""What every request model shares: strict fields, valid Unicode, and the keys clients add inside messages."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import islice
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

logger = logging.getLogger(__name__)

# Unknown keys are client text of any length and any characters: the log names a few, quoted and cut short.
LOGGED_KEYS = 5
LOGGED_KEY_CHARS = 40


def _valid_unicode(value: str) -> str:
    """JSON escapes can carry lone UTF-16 surrogates, which no tokenizer (and no UTF-8 response) can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains invalid Unicode (a lone surrogate at position {exc.start})") from None
    return value


# Every string of a request: valid Unicode, never coerced from another type.
Text = Annotated[str, AfterValidator(_valid_unicode)]


class Strict(BaseModel):
    # Unknown fields are answered with a 400 that names them, never dropped silently; like OpenAI, no
    # coercion: "2", 2.0 or true are not integers, "yes" is not a boolean (JSON integers are valid floats).
    # Python's json reads NaN and Infinity, which JSON does not have: no number field takes them.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Tolerant(BaseModel):
    """Inside messages and content parts, keys a client adds (`cache_control`, `provider_specific_fields`, ...)
    are ignored with a warning: unknown top-level fields still get their 400."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _ignore_extra_keys(self) -> Any:
        if self.model_extra:
            count = len(self.model_extra)
            logger.warning(
                "ignored %d unknown key%s in a %s: %s",
                count,
                "" if count == 1 else "s",
                type(self).__name__,
                _key_names(self.model_extra, count),
            )
            self.model_extra.clear()
        return self


def _key_names(keys: Iterable[str], count: int) -> str:
    names = [
        repr(key[:LOGGED_KEY_CHARS]) + ("..." if len(key) > LOGGED_KEY_CHARS else "")
        for key in islice(keys, LOGGED_KEYS)
    ]
    return ", ".join(names) + (f" and {count - LOGGED_KEYS} more" if count > LOGGED_KEYS else "")
