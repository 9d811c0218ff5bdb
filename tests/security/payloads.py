"""Payloads of the security tier that would leave a trace if anything executed them."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


class Payload:
    """Unpickling this runs `touch MARKER`: the file's existence is the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker), protocol=4)
