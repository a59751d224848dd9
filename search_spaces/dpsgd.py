"""dpsgd: the clipping norm C and the effective step lr * C (see the package docstring)."""

from __future__ import annotations

from search_spaces import SGD_CLIP, SGD_STEP, Space, register

SPACE = register(Space(method="dpsgd", ranges={"clip_norm": SGD_CLIP}, step=SGD_STEP))
