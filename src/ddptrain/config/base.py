"""The base of every config section, and the bounds shared by several sections."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from ddptrain.config_io import (
    one_line_text,
)

# Bounds that keep values meaningful: timedelta overflows past ~1e9 days, NumPy seeds are 32-bit,
# and a timeout of more than a week is a typo, not a plan.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SEED = 2**32 - 1
# A path or name written into scripts, manifests and logs: one line.
LineText = Annotated[str, AfterValidator(one_line_text)]


class Section(BaseModel):
    """A config section: unknown keys, coercion and non-finite numbers are errors."""

    # strict: no silent coercion (`train.max_steps=true` is not 1, "3" is not 3); ints still
    # count as floats. allow_inf_nan=False: a NaN or infinite lr/timeout can never train.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, strict=True, allow_inf_nan=False
    )
