"""LLM.start_profile() / stop_profile(): vLLM's profiler_config, on every tensor-parallel rank.

`LLM(model, profiler_config={"profiler": "torch", "torch_profiler_dir": "./traces"})`, then
start_profile() ... stop_profile() around the calls to look at: each rank writes a trace that
chrome://tracing or Perfetto opens (`<prefix>_tp<rank>.<time>.pt.trace.json.gz`) and the table of
its kernels by time (`profiler_out_<rank>.txt`, also printed by rank 0). "cuda" brackets the
calls with cudaProfilerStart / Stop instead, for `nsys profile --capture-range=cudaProfilerApi`.
"""
import os
from dataclasses import dataclass, fields

import torch

from nanovllm.logger import init_logger

logger = init_logger(__name__)
# vLLM's ProfilerConfig fields for what is not done here (profiling a range of engine steps, the
# API server's own trace), accepted at their defaults only.
IDLE_FIELDS = {"capture_torch_profiler": False, "detailed_trace_annotation": False, "ignore_frontend": False,
               "delay_iterations": 0, "max_iterations": 0, "warmup_iterations": 0, "active_iterations": 5,
               "wait_iterations": 0}


@dataclass
class ProfilerConfig:
    profiler: str | None = None                   # "torch" | "cuda" | None (start_profile refused)
    torch_profiler_dir: str = ""                  # where "torch" writes; required with it
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True   # the table of kernels by time
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False

    @classmethod
    def parse(cls, value) -> "ProfilerConfig | None":
        """LLM(profiler_config=...): None, a dict, or an object with vLLM's ProfilerConfig fields."""
        if value is None or isinstance(value, cls):
            return value
        given = dict(value) if isinstance(value, dict) else {k: v for k, v in vars(value).items()
                                                             if not k.startswith("_")}
        ours = {f.name for f in fields(cls)}
        for name, setting in given.items():
            if name in ours:
                continue
            if name not in IDLE_FIELDS:
                raise ValueError(f"profiler_config: unknown field {name!r}.")
            if setting != IDLE_FIELDS[name]:
                raise ValueError(f"profiler_config.{name} is not supported (only {IDLE_FIELDS[name]!r}): "
                                 f"start_profile() and stop_profile() bracket what is profiled, got {setting!r}.")
        return cls(**{k: v for k, v in given.items() if k in ours})

    def __post_init__(self):
        if self.profiler not in (None, "torch", "cuda"):
            raise ValueError(f"profiler_config.profiler must be 'torch', 'cuda' or None, got {self.profiler!r}.")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config.torch_profiler_dir must be set when profiler is 'torch'.")
        if self.torch_profiler_dir and self.profiler != "torch":
            raise ValueError("profiler_config.torch_profiler_dir is only applicable when profiler is 'torch', "
                             f"got profiler={self.profiler!r}.")
        if self.profiler == "cuda" and not torch.cuda.is_available():
            raise ValueError("profiler_config.profiler 'cuda' needs a CUDA device; use 'torch'.")
        if self.torch_profiler_dir:
            self.torch_profiler_dir = os.path.abspath(os.path.expanduser(self.torch_profiler_dir))


class RankProfiler:
    """One rank's profiler: start(prefix) ... stop()."""

    def __init__(self, config: ProfilerConfig, rank: int, device: torch.device):
        self.config, self.rank, self.device = config, rank, device
        self.active: torch.profiler.profile | bool | None = None

    def start(self, prefix: str | None = None):
        if self.config.profiler is None:
            raise RuntimeError("Profiling is not enabled: pass LLM(..., profiler_config={'profiler': 'torch', "
                               "'torch_profiler_dir': DIR}) to profile with start_profile() / stop_profile().")
        if self.active is not None:           # (vLLM's answer too)
            logger.warning("start_profile() while the profiler is running: ignored.")
            return
        if self.config.profiler == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.start()
            self.active = True
            return
        c = self.config
        os.makedirs(c.torch_profiler_dir, exist_ok=True)
        name = f"{prefix}_tp{self.rank}" if prefix else f"tp{self.rank}"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.active = torch.profiler.profile(
            activities=activities, record_shapes=c.torch_profiler_record_shapes,
            profile_memory=c.torch_profiler_with_memory, with_stack=c.torch_profiler_with_stack,
            with_flops=c.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(c.torch_profiler_dir, worker_name=name,
                                                                    use_gzip=c.torch_profiler_use_gzip))
        self.active.start()

    def stop(self):
        if self.active is None:
            logger.warning("stop_profile() while the profiler is not running: ignored.")
            return
        profile, self.active = self.active, None
        if self.config.profiler == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.stop()
            return
        profile.stop()                                  # writes the trace (on_trace_ready)
        if self.config.torch_profiler_dump_cuda_time_total:
            sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = profile.key_averages().table(sort_by=sort_by)
            with open(os.path.join(self.config.torch_profiler_dir, f"profiler_out_{self.rank}.txt"), "w") as f:
                print(table, file=f)
            if self.rank == 0:
                print(table)
