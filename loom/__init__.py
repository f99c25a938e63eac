"""loom: a readable LLM inference engine and OpenAI-compatible server on PyTorch."""

from importlib.metadata import PackageNotFoundError, version

from loom.config import EngineArgs
from loom.engine.beam_search import BeamSearchParams
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import SamplingParams

try:
    __version__ = version("loom")
except PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "EngineArgs", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "LLM"]


def __getattr__(name: str):  # LLM pulls in torch; keep `import loom` light for the core tests
    if name == "LLM":
        from loom.engine.llm import LLM

        return LLM
    raise AttributeError(name)
