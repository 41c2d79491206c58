"""vLLM's FlexibleArgumentParser, for scripts that import it: an ArgumentParser that also takes
--flag_name for --flag-name, -O3 (or -O 3, -O=3) for --optimization-level 3, and a JSON argument
key by key: --hf-overrides.rope_theta 1e6 --hf-overrides.rope_scaling.factor=4 for
--hf-overrides '{"rope_theta": 1e6, "rope_scaling": {"factor": 4}}'."""
import argparse
import json
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        args = _merged_keys([part for arg in args for part in _spelled_out(arg)])
        return super().parse_known_args(args, namespace)


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
    """--name.key value and --name.a.b=value (or a short flag's -cc.key; each value as JSON where it
    is JSON, else as text), merged into one --name '{...}' per flag, after the other arguments."""
    merged, rest = {}, []
    args = iter(args)
    for arg in args:
        name, sep, value = arg.partition("=")
        if not (name[:1] == "-" and name.lstrip("-")[:1].isalpha() and "." in name):   # (not -1.5)
            rest.append(arg)
            continue
        flag, *keys = name.split(".")
        value = value if sep else next(args, "")
        node = merged.setdefault(flag, {})
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        try:
            node[keys[-1]] = json.loads(value)
        except ValueError:
            node[keys[-1]] = value
    return rest + [part for flag, tree in merged.items() for part in (flag, json.dumps(tree))]
