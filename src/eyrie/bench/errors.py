"""What a benchmark refuses to report, as exceptions: the run writes its JSON with the error first, then raises one."""

from __future__ import annotations

from eyrie.core.errors import EyrieError


class BenchmarkError(EyrieError):
    pass


class DrafterNotEngagedError(BenchmarkError):
    """The measured mean acceptance length is below bench.min_acceptance_length."""


class NonFiniteDrafterError(BenchmarkError):
    """The drafter's logits are NaN or infinite: there is nothing to measure."""


class ParityGapError(BenchmarkError):
    """The measured acceptance length is further below training's prediction than bench.max_parity_gap."""
