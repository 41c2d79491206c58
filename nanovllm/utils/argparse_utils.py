"""vLLM's FlexibleArgumentParser, for scripts that import it: an ArgumentParser that also takes
--flag_name for --flag-name."""
import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    """--max_num_seqs=8 -> --max-num-seqs=8; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
