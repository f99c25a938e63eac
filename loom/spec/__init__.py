"""Speculative decoding: proposers guess the next tokens of a request, one target pass verifies them.

A decode step at small batch is bound by reading the weights, so checking k proposed tokens in one forward
pass costs about as much as producing one token, and every accepted token is nearly free (Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling"). docs/speculative.md describes the methods and the
exactness guarantee.

- proposer.py: the `Proposer` Protocol, the registry behind `--speculative-method`, the n-gram proposer;
- verify.py: acceptance of drafted tokens, greedy and by rejection sampling (imports torch; the rest of
  this package does not, so the scheduler can use it).
"""

from loom.spec.proposer import (
    PROPOSERS,
    DraftRequest,
    NgramProposer,
    PerRequestProposer,
    Proposer,
    SpeculativeConfig,
    make_proposer,
)

__all__ = ["PROPOSERS", "DraftRequest", "NgramProposer", "PerRequestProposer", "Proposer", "SpeculativeConfig",
           "make_proposer"]
