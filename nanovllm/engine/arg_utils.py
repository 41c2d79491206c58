"""EngineArgs: vLLM's engine arguments, for LLMEngine.from_engine_args and for scripts that take
them on the command line (EngineArgs.add_cli_args / from_cli_args): LLM()'s keyword arguments,
that is Config's fields, by vLLM's names and flags (--max-num-seqs, --enforce-eager / --no-...)."""
import argparse
import json
import types
from dataclasses import MISSING, fields

from nanovllm.config import Config
from nanovllm.utils.argparse_utils import human_readable_int, human_readable_int_or_auto
from nanovllm.vllm_only_arguments import IDLE_ARGUMENTS, IGNORED_ARGUMENTS

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"   # vLLM's
SHORT_FLAGS = {   # vLLM's short spellings of its flags (-O3 for --optimization-level 3: FlexibleArgumentParser)
    "quantization": "-q", "tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "nnodes": "-n",
    "node_rank": "-r", "decode_context_parallel_size": "-dcp", "prefill_context_parallel_size": "-pcp",
    "data_parallel_size": "-dp", "data_parallel_rank": "-dpn", "data_parallel_start_rank": "-dpr",
    "data_parallel_size_local": "-dpl", "data_parallel_address": "-dpa", "data_parallel_rpc_port": "-dpp",
    "data_parallel_backend": "-dpb", "data_parallel_hybrid_lb": "-dph", "data_parallel_external_lb": "-dpe",
    "data_parallel_multi_port_external_lb": "-dpm", "enable_expert_parallel": "-ep", "speculative_config": "-sc",
    "diffusion_config": "-dc", "compilation_config": "-cc", "attention_config": "-ac",
}
# vLLM's flags that take 16k, 1.5m or 8G for 16,000, 1,500,000 or 8 * 2**30 (max_model_len also auto: -1)
HUMAN_READABLE = {"max_model_len": human_readable_int_or_auto, "max_num_batched_tokens": human_readable_int,
                  "kv_cache_memory_bytes": human_readable_int, "max_num_scheduled_tokens": human_readable_int,
                  "safetensors_prefetch_block_size": human_readable_int}


def _settings() -> dict:
    """Config's settable fields but the model -> their defaults."""
    return {f.name: f.default for f in fields(Config) if f.init and f.name != "model"}


def _vllm_only_flags() -> dict:
    """vLLM's arguments that nanovllm has no use for (vllm_only_arguments.py) -> (argparse options, help):
    typed as their vLLM default, so that a flag at that default compares equal to it (and a boolean
    one takes vLLM's --name / --no-name)."""
    flags = {}
    for arguments, text in ((IDLE_ARGUMENTS, "only {default!r} here ({reason})"),
                            (IGNORED_ARGUMENTS, "not used ({reason})")):
        for name, (default, reason) in arguments.items():
            if not name.startswith("_"):
                kind = {bool: bool, int: int, float: float, str: str}.get(type(default))
                options = _flag_options(kind) if kind else {"nargs": "*", "type": _json_or_text, "action": _Values}
                flags[name] = (options, "vLLM's; " + text.format(default=default, reason=reason))
    return flags


class EngineArgs:
    """EngineArgs(model=..., max_num_seqs=8, ...): the arguments are checked when the engine is
    made (Config.from_kwargs); unset ones read as Config's defaults, but for vLLM's EngineArgs
    defaults that differ from LLM()'s (ENGINE_DEFAULTS: an engine made from engine arguments logs
    its stats, as vLLM's does)."""
    ENGINE_DEFAULTS = {"disable_log_stats": False}

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.model = model
        self.kwargs = {**self.ENGINE_DEFAULTS, **kwargs}

    def __getattr__(self, name: str):
        kwargs = self.__dict__.get("kwargs", {})
        if name in kwargs:
            return kwargs[name]
        default = _settings().get(name, MISSING)
        if default is MISSING:
            default = {**IDLE_ARGUMENTS, **IGNORED_ARGUMENTS}.get(name, (MISSING,))[0]
        if default is MISSING:
            raise AttributeError(f"EngineArgs has no argument {name!r}.")
        return default

    def create_engine_config(self, usage_context=None) -> Config:
        return Config.from_kwargs(self.model, **self.kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per argument (and vLLM's short spellings, SHORT_FLAGS); only the flags given reach
        from_cli_args (the rest keep Config's defaults). Dict-valued arguments take JSON."""
        parser.add_argument("--model", default=DEFAULT_MODEL, help="a local directory or a Hugging Face hub id")
        defaults = {**_settings(), **EngineArgs.ENGINE_DEFAULTS}
        flags = {f.name: (_flag_options(f.type), f"default: {defaults[f.name]!r}")
                 for f in fields(Config) if f.name in defaults}
        for name, (options, text) in {**flags, **_vllm_only_flags()}.items():
            if name in HUMAN_READABLE:
                options = {**options, "type": HUMAN_READABLE[name]}
            spellings = ["--" + name.replace("_", "-")] + ([SHORT_FLAGS[name]] if name in SHORT_FLAGS else [])
            parser.add_argument(*spellings, dest=name, default=argparse.SUPPRESS, help=text, **options)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = [*_settings(), *IDLE_ARGUMENTS, *IGNORED_ARGUMENTS]
        given = {name: getattr(args, name) for name in names if hasattr(args, name)}
        return cls(model=args.model, **given)


def _flag_options(annotation) -> dict:
    """argparse options for a Config field of this type."""
    kinds = set(annotation.__args__) - {type(None)} if isinstance(annotation, types.UnionType) else {annotation}
    if kinds == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if kinds == {bool, str}:
        return {"type": str, "nargs": "?", "const": True}   # vLLM's: --hf-token alone is True
    if kinds in ({int}, {float}):
        return {"type": kinds.pop()}
    if dict in kinds or kinds == {object}:
        return {"type": json.loads}
    if any(getattr(kind, "__origin__", None) is list for kind in kinds):
        return {"type": str, "nargs": "+"}      # vLLM's: --served-model-name a b
    return {"type": str}


class _Values(argparse.Action):
    """A vLLM flag whose value is not a scalar (a config as JSON, a list, a bool that may be None):
    `--name` alone is True, `--name 1 2 4` a list, `--name '{"a": 1}'` the one value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if not values else values[0] if len(values) == 1 else values)


def _json_or_text(text: str):
    """A flag's value as JSON where it is JSON ('{}', 'null', '[1, 2]'), else as the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text
