"""EngineArgs: vLLM's engine arguments, for LLMEngine.from_engine_args and for scripts that take
them on the command line (EngineArgs.add_cli_args / from_cli_args): LLM()'s keyword arguments,
that is Config's fields, by vLLM's names and flags (--max-num-seqs, --enforce-eager / --no-...)."""
import argparse
import json
import types
from dataclasses import MISSING, fields

from nanovllm.config import Config

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"   # vLLM's


def _settings() -> dict:
    """Config's settable fields but the model -> their defaults."""
    return {f.name: f.default for f in fields(Config) if f.init and f.name != "model"}


class EngineArgs:
    """EngineArgs(model=..., max_num_seqs=8, ...): the arguments are checked when the engine is
    made (Config.from_kwargs); unset ones read as Config's defaults."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.model = model
        self.kwargs = kwargs

    def __getattr__(self, name: str):
        kwargs = self.__dict__.get("kwargs", {})
        if name in kwargs:
            return kwargs[name]
        default = _settings().get(name, MISSING)
        if default is MISSING:
            raise AttributeError(f"EngineArgs has no argument {name!r}.")
        return default

    def create_engine_config(self, usage_context=None) -> Config:
        return Config.from_kwargs(self.model, **self.kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per argument; only the flags given reach from_cli_args (the rest keep Config's
        defaults). Dict-valued arguments take JSON."""
        parser.add_argument("--model", default=DEFAULT_MODEL, help="a local directory or a Hugging Face hub id")
        for f in fields(Config):
            if f.init and f.name != "model":
                parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=argparse.SUPPRESS,
                                    help=f"default: {f.default!r}", **_flag_options(f.type))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        given = {name: getattr(args, name) for name in _settings() if hasattr(args, name)}
        return cls(model=args.model, **given)


def _flag_options(annotation) -> dict:
    """argparse options for a Config field of this type."""
    kinds = set(annotation.__args__) - {type(None)} if isinstance(annotation, types.UnionType) else {annotation}
    if kinds == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if kinds in ({int}, {float}):
        return {"type": kinds.pop()}
    if dict in kinds or kinds == {object}:
        return {"type": json.loads}
    return {"type": str}
