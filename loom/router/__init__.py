"""The serving fleet: a router over replicas of `loom serve`, and the exact result cache.

Torch-free, like loom.core: the router is a small process that never loads a model (a test enforces it).
"""
