"""The engine's periodic log line, as vLLM prints it when `LLM(disable_log_stats=False)`:
throughput since the last line, the queues, KV-cache use and the prefix-cache hit rate since start;
with speculative decoding vLLM's second line, the drafts since the last line."""
import time

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.logger import init_logger
from nanovllm.metrics import DraftCounts

logger = init_logger(__name__)


class StatLogger:
    def __init__(self, interval_s: float = 10.0, num_speculative_tokens: int = 0):
        self.interval_s = interval_s   # vLLM's VLLM_LOG_STATS_INTERVAL default
        self.since = time.monotonic()
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.drafts = DraftCounts(num_speculative_tokens)   # since the last line

    def record_drafts(self, num_draft_tokens: int, num_accepted_tokens: int):
        """One sequence's drafts in a step; the accepted ones are generated tokens too (record() counts
        one a sampling sequence)."""
        self.drafts.record(num_draft_tokens, num_accepted_tokens)
        self.num_generation_tokens += num_accepted_tokens

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
        drafts = self.drafts
        if drafts.num_drafts:
            rates = ", ".join(f"{n / drafts.num_drafts:.3f}" for n in drafts.num_accepted_tokens_per_pos)
            logger.info(f"SpecDecoding metrics: Mean acceptance length: "
                        f"{1 + drafts.num_accepted_tokens / drafts.num_drafts:.2f}, "
                        f"Accepted throughput: {drafts.num_accepted_tokens / elapsed:.2f} tokens/s, "
                        f"Drafted throughput: {drafts.num_draft_tokens / elapsed:.2f} tokens/s, "
                        f"Accepted: {drafts.num_accepted_tokens} tokens, Drafted: {drafts.num_draft_tokens} tokens, "
                        f"Per-position acceptance rate: {rates}, "
                        f"Avg Draft acceptance rate: {drafts.num_accepted_tokens / drafts.num_draft_tokens:.1%}")
            self.drafts = DraftCounts(drafts.num_speculative_tokens)
        self.since = now
        self.num_prompt_tokens = self.num_generation_tokens = 0
