"""Sampling: logits -> one token per request (sampler.py), history-dependent logit processing (penalties.py)."""
