"""The engine's periodic log line, as vLLM prints it when `LLM(disable_log_stats=False)`:
throughput since the last line, the queues, KV-cache use and the prefix-cache hit rate since start."""
import time

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.logger import init_logger

logger = init_logger(__name__)


class StatLogger:
    def __init__(self, interval_s: float = 10.0):   # vLLM's VLLM_LOG_STATS_INTERVAL default
        self.interval_s = interval_s
        self.since = time.monotonic()
        self.num_prompt_tokens = self.num_generation_tokens = 0

    def record(self, num_prompt_tokens: int, num_generation_tokens: int, scheduler: Scheduler,
               block_manager: BlockManager):
        """Count one step's tokens; log a line when interval_s has passed since the last one."""
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        if time.monotonic() - self.since >= self.interval_s:
            self.log(scheduler, block_manager)

    def log(self, scheduler: Scheduler, block_manager: BlockManager):
        """Log the line now: throughput since the last one, the queues and the caches."""
        now = time.monotonic()
        elapsed = max(now - self.since, 1e-9)
        used = 1 - block_manager.num_free_blocks / block_manager.num_blocks
        queries = scheduler.num_prefix_cache_queries
        hit_rate = scheduler.num_prefix_cache_hits / queries if queries else 0.0
        logger.info(f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
                    f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
                    f"Running: {len(scheduler.running)} reqs, Waiting: {len(scheduler.waiting)} reqs, "
                    f"KV cache usage: {used:.1%}, Prefix cache hit rate: {hit_rate:.1%}")
        self.since = now
        self.num_prompt_tokens = self.num_generation_tokens = 0
