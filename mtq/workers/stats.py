"""The histograms a worker keeps for ``mtq metrics serve``; they live in
:mod:`mtq.observe.histograms`.

This path is kept for code that imports it.
"""

from mtq.observe.histograms import BOUNDS, SECONDS, TOKENS_PER_S, Histograms, Sent

__all__ = ["BOUNDS", "SECONDS", "TOKENS_PER_S", "Histograms", "Sent"]
