"""vLLM's FlexibleArgumentParser, for scripts that import it: an ArgumentParser that also takes
--flag_name for --flag-name, -O3 (or -O 3, -O=3) for --optimization-level 3, a JSON argument
key by key: --hf-overrides.rope_theta 1e6 --hf-overrides.rope_scaling.factor=4 for
--hf-overrides '{"rope_theta": 1e6, "rope_scaling": {"factor": 4}}', and flags from a YAML file:
--config engine.yaml."""
import argparse
import json
import re
import sys

DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if "--config" in args:
            args = self._with_config_file(args)
        args = _merged_keys([part for arg in args for part in _spelled_out(arg)])
        return super().parse_known_args(args, namespace)

    def _with_config_file(self, args: list[str]) -> list[str]:
        """--config FILE replaced by the file's flags, put before the other flags (so those win) and
        after a leading positional argument, as vLLM does."""
        if args.count("--config") > 1:
            raise ValueError("More than one config file specified!")
        at = args.index("--config")
        if at == len(args) - 1:
            raise ValueError("No config file specified! Please check your command-line arguments.")
        flags = self.load_config_file(args[at + 1])
        rest = args[:at] + args[at + 2:]
        head = 1 if rest and not rest[0].startswith("-") else 0
        return rest[:head] + flags + rest[head:]

    def load_config_file(self, file_path: str) -> list[str]:
        """A YAML file of flags -> the command line it stands for, as vLLM reads it: `key: value` is
        --key value, `key: true` --key, `key: [a, b]` --key a b, a mapping --key as JSON. `key: false`
        is --no-key where the parser has that flag, and left out otherwise (as vLLM leaves it out)."""
        import yaml   # (transformers' dependency)
        extension = file_path.rsplit(".", 1)[-1]
        if extension not in ("yaml", "yml"):
            raise ValueError(f"Config file must be of a yaml/yml type. {extension} supplied")
        try:
            with open(file_path) as f:
                config = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--config {file_path!r} cannot be read: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--config {file_path!r} must hold a mapping of flags to values, "
                             f"got {type(config).__name__}.")
        flags = []
        for key, value in config.items():
            flag = "--" + str(key)
            if value is False:
                negated = "--no-" + str(key).replace("_", "-")
                flags += [negated] if negated in self._option_string_actions else []
            elif value is True:
                flags.append(flag)
            elif isinstance(value, list):
                flags += [flag, *map(str, value)] if value else []
            elif isinstance(value, dict):
                flags += [flag, json.dumps(value)]
            else:
                flags += [flag, str(value)]
        return flags


def _spelled_out(arg: str) -> list[str]:
    """vLLM's -O3 / -O=3 -> --optimization-level 3, a lone -O -> --optimization-level, else _dashed(arg)."""
    if arg == "-O":
        return ["--optimization-level"]
    if arg.startswith("-O"):
        return ["--optimization-level", arg[2:].removeprefix("=")]
    return [_dashed(arg)]


def _dashed(arg: str) -> str:
    """--max_num_seqs=8 -> --max-num-seqs=8 (in a dotted --hf_overrides.rope_theta only the flag's
    part); anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    flag, dot, keys = name.partition(".")
    return flag.replace("_", "-") + dot + keys + sep + value


def _merged_keys(args: list[str]) -> list[str]:
    """--name.key value and --name.a.b=value (or a short flag's -cc.key) merged into one --name '{...}'
    per flag, after the other arguments. A value is JSON where it is JSON, else a human-readable
    number (16k), else text; --name.key+ a,b is the list ["a", "b"], and lists given twice are joined."""
    merged, rest = {}, []
    args = iter(args)
    for arg in args:
        name, sep, text = arg.partition("=")
        if not (name[:1] == "-" and name.lstrip("-")[:1].isalpha() and "." in name):   # (not -1.5)
            rest.append(arg)
            continue
        text = text if sep else next(args, "")
        flag, *keys = name.removesuffix("+").split(".")
        value = text.split(",") if name.endswith("+") else _json_number_or_text(text)
        node = merged.setdefault(flag, {})
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        old = node.get(keys[-1])
        node[keys[-1]] = old + value if isinstance(old, list) and isinstance(value, list) else value
    return rest + [part for flag, tree in merged.items() for part in (flag, json.dumps(tree))]


def _json_number_or_text(text: str):
    for parse in (json.loads, human_readable_int):
        try:
            return parse(text)
        except (ValueError, argparse.ArgumentTypeError):
            pass
    return text


def human_readable_int(text: str) -> int:
    """vLLM's: '25.6k' -> 25,600 (k, m, g, t: powers of 1,000), '2K' -> 2,048 (K, M, G, T: powers of 1,024,
    whole numbers only), else int(text)."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if not match:
        return int(text)
    number, suffix = match.groups()
    if suffix in DECIMAL:
        return int(float(number) * DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"Decimals are not allowed with binary suffixes like {suffix}. "
                                         f"Did you mean to use {number}{suffix.lower()} instead?")
    return int(number) * BINARY[suffix]


def human_readable_int_or_auto(text: str) -> int:
    """human_readable_int, and 'auto' (or -1) for -1: max_model_len's "what the KV cache holds"."""
    return -1 if text.strip().lower() in ("auto", "-1") else human_readable_int(text)
