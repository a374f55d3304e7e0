"""Generation, once for every face: the sampler, speculative decoding, and the fixed-batch compiled loops.

`generate`, `stream` and `speculate` run a `kvattn.models.CausalLM` with
contiguous caches in one compiled program; the serving engine
(`kvattn.serving.Server`, `kvattn.LLM`, `kvattn serve`) runs paged models.
Both draw every token through `kvattn.generation.sampling` and speculate
through `kvattn.generation.speculation`.
"""

from kvattn.generation.drafters import DraftModel, PromptLookup
from kvattn.generation.generate import Generated, generate, stream
from kvattn.generation.sampling import Sampling, SamplingParams, StructuredOutputs
from kvattn.generation.speculation import Policy
from kvattn.generation.speculative import Speculated, speculate

__all__ = [
    "DraftModel",
    "Generated",
    "Policy",
    "PromptLookup",
    "Sampling",
    "SamplingParams",
    "Speculated",
    "StructuredOutputs",
    "generate",
    "speculate",
    "stream",
]
