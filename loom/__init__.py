"""loom: a readable LLM inference engine and OpenAI-compatible server on PyTorch."""

from loom.config import EngineArgs
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import SamplingParams

__all__ = ["EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "LLM"]


def __getattr__(name: str):  # LLM pulls in torch; keep `import loom` light for the core tests
    if name == "LLM":
        from loom.engine.llm import LLM

        return LLM
    raise AttributeError(name)
