"""Pure functions run through torch.compile, or eagerly once compiling fails (train.fused_loss, train.fused_norms,
train.compile).

A compile failure (no C++ compiler for inductor's CPU code, an op dynamo cannot trace, ...) must not stop a training
job hours in: it is warned of once, kept in `error`, and every piece runs eagerly from then on, the same formulas at
eager speed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


class FusedPieces:
    """Named pure functions (`pieces`), each run as compiled(name) while fused and active, else eagerly.

    compiled(name) is called at each run, so a module's cached compile (or a test's stand-in for it) is what runs.
    setting names the config key in the warning, eager_note what then runs eagerly ("the loss runs eagerly"). Inside an
    outer torch.compile the eager function runs: the outer graph fuses it. settings, if given, returns the (config
    module, key, value) triples set around each compiled call and restored after it.
    """

    def __init__(self, fused: bool, pieces: dict[str, Callable], compiled: Callable[[str], Callable], setting: str, eager_note: str,
                 settings: Callable[[], list[tuple]] | None = None):
        self.fused, self.pieces, self.compiled = fused, pieces, compiled
        self.setting, self.eager_note, self.settings = setting, eager_note, settings
        self.error: str | None = None

    @property
    def active(self) -> bool:
        return self.fused and self.error is None

    def run(self, name: str, *args):
        return self.run_reporting(name, *args)[0]

    def run_reporting(self, name: str, *args) -> tuple:
        """(pieces[name](*args), whether it ran compiled)."""
        if self.active and not torch.compiler.is_compiling():
            settings = self.settings() if self.settings else []
            saved = [getattr(config, key) for config, key, _ in settings]
            for config, key, value in settings:
                setattr(config, key, value)
            try:
                return self.compiled(name)(*args), True
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 -- inductor and dynamo raise many types; any of them means: run eagerly
                self.error = f"{name}: {type(exc).__name__}: {exc}".strip()[:2000]
                warnings.warn(f"{self.setting}: torch.compile failed, {self.eager_note} (same values, eager speed): {self.error}",
                              RuntimeWarning, stacklevel=4)
            finally:
                for (config, key, _), value in zip(settings, saved):
                    setattr(config, key, value)
        return self.pieces[name](*args), False


def fuses_on_cuda(setting, device) -> bool:
    """A fused_* setting settled for a device: auto fuses on CUDA (Triton), not on a CPU (inductor's C++ compiles slowly)."""
    return setting is True or (setting == "auto" and torch.device(device).type == "cuda")
