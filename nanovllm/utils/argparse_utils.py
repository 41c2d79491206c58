"""vLLM's FlexibleArgumentParser, for scripts that import it: an ArgumentParser that also takes
--flag_name for --flag-name, and -O3 (or -O 3, -O=3) for --optimization-level 3."""
import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args([part for arg in args for part in _spelled_out(arg)], namespace)


def _spelled_out(arg: str) -> list[str]:
    """vLLM's -O3 / -O=3 -> --optimization-level 3, a lone -O -> --optimization-level, else _dashed(arg)."""
    if arg == "-O":
        return ["--optimization-level"]
    if arg.startswith("-O"):
        return ["--optimization-level", arg[2:].removeprefix("=")]
    return [_dashed(arg)]


def _dashed(arg: str) -> str:
    """--max_num_seqs=8 -> --max-num-seqs=8; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
