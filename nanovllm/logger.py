"""The `nanovllm` logger: INFO to stderr by default (as vLLM logs), NANOVLLM_LOGGING_LEVEL to change."""
import logging
import os

_root = logging.getLogger("nanovllm")
if not _root.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(os.environ.get("NANOVLLM_LOGGING_LEVEL", "INFO").upper())
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
