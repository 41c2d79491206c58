"""nanovllm: a small, readable, fast LLM inference engine with vLLM's offline API."""
from nanovllm.beam_search import BeamSearchOutput, BeamSearchSequence
from nanovllm.engine.arg_utils import EngineArgs
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.inputs import EmbedsPrompt, PromptType, TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.logprobs import Logprob
from nanovllm.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "TextPrompt", "TokensPrompt", "EmbedsPrompt",
           "PromptType", "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ScoringOutput", "ScoringRequestOutput", "ClassificationOutput",
           "ClassificationRequestOutput"]
__version__ = "0.1.0"
