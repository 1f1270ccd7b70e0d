"""Compiled kernels the package runs only after checking them on this machine.

``checks.py`` keeps the verdicts (one warning per failing kernel, a list for the run card); ``flex.py`` checks the
compiled ``flex_attention``; ``compiled_blocks.py`` checks ``torch.compile``'d decoder blocks on CPU.
"""

from lightning_moe.kernels.checks import kernel_checks, reset_kernel_checks

__all__ = ["kernel_checks", "reset_kernel_checks"]
