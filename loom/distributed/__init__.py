"""Model parallelism on torch.distributed: process groups and the tensor-parallel split of a decoder."""
