"""Console noise of optional dependencies, dropped at its logger by message (nothing else they log is touched).

torchao loads optional C++/CUDA kernels when it is imported (transformers imports it to check for its
quantizer) and logs a warning for every one built for another torch or Python, after which it uses its Python
paths; torch logs a deprecation for each enum torchao registers; Lightning advertises its cloud services at
every run and warns about a torch API its own utility still calls. Each process printed them on every run.
"""

from __future__ import annotations

import logging
import re
import warnings

NOISE = {
    "torchao": re.compile(r"Failed to load .*\.so"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
    "lightning.pytorch.utilities.rank_zero": re.compile(r"^💡 Tip: "),
}
# Lightning 2.6's pytree helper under torch >= 2.9
WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_known_noise() -> None:
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message)
