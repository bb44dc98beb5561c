"""Reading a safetensors file a user named (a problem, outputs, a trace, a dump's step): the one
place that decides what counts as missing or unreadable and what the reason says.  Each caller
words the one-line error in its own terms, from ``UnreadableFile``."""
from __future__ import annotations

import os

from safetensors import safe_open


class UnreadableFile(Exception):
    """A safetensors file that does not exist (``missing``) or does not parse; ``reason`` is
    "no such file" or "<error type>: <first line of the parser's message>"."""

    def __init__(self, path: str, missing: bool, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.missing, self.reason = path, missing, reason

    def line(self, what: str) -> str:
        """The usual one-line error for argument ``what``: "what: expected an existing safetensors
        file, got 'P' (no such file)", or "what: expected a safetensors file, got 'P' that cannot
        be read (reason)"."""
        if self.missing:
            return f"{what}: expected an existing safetensors file, got {self.path!r} (no such file)"
        return f"{what}: expected a safetensors file, got {self.path!r} that cannot be read ({self.reason})"


def read_safetensors(path) -> tuple:
    """(tensors by name, metadata dict) of the safetensors file at ``path`` (a str or a Path), read
    whole on the CPU; UnreadableFile when it is missing or any part of it does not parse."""
    path = str(path)
    if not os.path.isfile(path):
        raise UnreadableFile(path, True, "no such file")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
        first = str(e).splitlines()[0] if str(e) else ""
        raise UnreadableFile(path, False, f"{type(e).__name__}: {first}") from None
    return tensors, meta
