"""``spear``'s options (shared with ``spear-features``, which runs spear on a ConvNet's features)."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import expect

__all__ = ["SpearOptions"]


@dataclass
class SpearOptions:
    """Tolerances and budgets of ``spear`` (0 = derived from the observation's precision)."""

    #: singular values below rcond·σ_max count as zero when reading the rank of ∂L/∂W.
    rcond: float = 0.0
    #: entries of L q below zero_tol·max|L q| are exact zeros (float32: ≈ 2e-6).
    zero_tol: float = 0.0
    #: a kernel direction is one whose singular value is below null_tol·σ_max.
    null_tol: float = 0.0
    #: relative residual of ∂L/∂W and ∂L/∂b a certified sample leaves.
    tol: float = 0.0
    #: at most this many rows of the gradient serve as candidate inputs per round.
    candidates: int = 1024
    #: rounds of completing Q with the best rejected proposals and re-proposing from the solved batch.
    rounds: int = 4
    #: wall-clock budget in seconds for SPEAR's rounds, and again for its pass on the whole gradient (0 = none);
    #: peeling passes are not cut.
    seconds: float = 60.0
    #: where SPEAR's kernels stall and a linear layer follows the ReLU layer, also propose directions that fit that
    #: layer's structure, g_i = D_i ⊙ W₂ᵀv_i (:mod:`.next_layer`; ours, not the paper's)
    next_layer: bool = True

    def check(self) -> None:
        for name in ("rcond", "zero_tol", "null_tol", "tol"):
            value = getattr(self, name)
            expect(0 <= value < 1, f"expected 0 ≤ {name} < 1 (0 = automatic), got {value} (option {name})")
        expect(self.candidates >= 1, f"expected candidates ≥ 1, got {self.candidates} (option candidates)")
        expect(self.rounds >= 0, f"expected rounds ≥ 0, got {self.rounds} (option rounds)")
        expect(self.seconds >= 0, f"expected seconds ≥ 0 (0 = no limit), got {self.seconds} (option seconds)")
        expect(isinstance(self.next_layer, bool), f"expected next_layer true or false, got {self.next_layer!r} "
               "(option next_layer)")
