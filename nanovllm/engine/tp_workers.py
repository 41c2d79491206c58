"""Tensor-parallel worker processes.

Rank 0 runs in the caller's process; ranks 1..N-1 are spawned processes that build the same
ModelRunner on their shard and mirror rank 0's steps. Control messages go through one pipe per
worker (no port or shared-memory name to clash, any message size); tensors move through the
group's collectives (gloo on the CPU, NCCL on CUDA), set up over a TCPStore on a free port.

vLLM's collective_rpc (a method of every rank's ModelRunner, or a function called with it) is
sent to the workers as pickled bytes before rank 0 runs its own part, and each worker answers on
its pipe with the call's number, so that an answer that comes after its call timed out is
recognised and dropped.

A step message is the flattened batch (new token ids, positions, slots) and the block-table
changes (engine/block_table_sync.py), never the sequences. Workers end on close(), on `del`, at
interpreter exit, or when the pipe to rank 0 closes; a dead worker is reported by rank, instead
of hanging the caller: a watchdog thread notes the moment a worker exits, and rank 0's waits for
the GPU end there. Collectives with a dead peer never finish on their own, so the group is
aborted: by the watchdog at once when the model runs eagerly, and by close() once the CUDA graphs
are destroyed when it runs graphs (NCCL's abort waits for every graph that captured its
collectives to be destroyed; aborting under live graphs hung rank 0 on 2x H200). The abort also
releases the symmetric-memory all-reduce's kernels that wait for the dead peer.
"""
import copy
import multiprocessing as mp
import multiprocessing.connection
import pickle
import signal
import threading
import time

from nanovllm import distributed

JOIN_TIMEOUT_S = 5.0


class WorkerDiedError(RuntimeError):
    pass


def run_method(runner, method, args: tuple, kwargs: dict):
    """One rank's part of collective_rpc: `method` names a public ModelRunner method, or is a
    function called with the runner first (vLLM passes its worker)."""
    if isinstance(method, str):
        return resolve_method(runner, method)(*args, **kwargs)
    return method(runner, *args, **kwargs)


def resolve_method(runner, name: str):
    func = getattr(runner, name, None) if not name.startswith("_") else None
    if not callable(func):
        raise ValueError(f"collective_rpc: method {name!r} is not implemented by the model runner.")
    return func


class TPWorkers:
    def __init__(self, config, eos_token_ids: set[int], device):
        size = config.tensor_parallel_size
        rendezvous = distributed.Rendezvous(size, device)
        port = rendezvous.port
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        config = copy.copy(config)   # (rank 0 samples: the others need no logits processors, which may not pickle)
        config.logits_processors = None
        for rank in range(1, size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(config, eos_token_ids, rank, port, child_end),
                               name=f"nanovllm-tp-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        self.closed = False
        self.rpc_count = 0              # collective_rpc calls sent so far (their answers carry it)
        self.group = self.watchdog = None
        self.dead = threading.Event()   # set by the watchdog when a worker exits
        self.abort_on_death = True      # the engine turns it off when the model runs CUDA graphs
        self.aborted = False
        try:
            for rank in range(1, size):          # a worker that dies while starting is named, not waited for
                while not rendezvous.has_arrived(rank):
                    self.check_alive()
                    time.sleep(0.01)
            self.group = rendezvous.join(not config.disable_custom_all_reduce)
        except BaseException:
            self.close()
            raise
        self._wake_watchdog, wake_end = ctx.Pipe()
        self.watchdog = threading.Thread(target=self._watch, args=(wake_end,), name="nanovllm-tp-watchdog",
                                         daemon=True)
        self.watchdog.start()

    def _watch(self, wake_end):
        """Wait for a worker to die; then mark the group dead and, unless CUDA graphs hold its
        collectives, abort it: aborted, rank 0's collectives fail at once instead of waiting for the
        dead peer, and the caller names the rank (check_alive). close() wakes it to end quietly."""
        multiprocessing.connection.wait([proc.sentinel for proc in self.procs] + [wake_end])
        if not self.closed:
            self.dead.set()
            if self.abort_on_death:
                self.group.abort()
                self.aborted = True

    def wait(self, event):
        """event.synchronize(), except that a worker's death ends the wait with WorkerDiedError
        (a step whose collectives wait for a dead peer would never finish)."""
        while not event.query():
            if self.dead.is_set():
                self.check_alive(grace_s=5.0)

    def check_alive(self, grace_s: float = 0.0):
        """Raise WorkerDiedError naming the first dead worker. grace_s: how long to wait for one
        to be seen dead (after a failed collective, a killed peer can still be exiting)."""
        if grace_s:
            ready = multiprocessing.connection.wait([proc.sentinel for proc in self.procs], timeout=grace_s)
            for proc in self.procs:
                if proc.sentinel in ready:
                    proc.join(grace_s)   # its pipe closes a moment before its exit status is there
        for rank, proc in enumerate(self.procs, 1):
            if proc.exitcode is not None:
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} exited with code {proc.exitcode}; "
                                      f"the engine is closed.")

    def send(self, message):
        self.check_alive()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} is gone; the engine is closed.") from None

    def start_rpc(self, method, args: tuple, kwargs: dict) -> int:
        """Send a collective_rpc call to every worker -> its number, for finish_rpc."""
        try:
            call = pickle.dumps((method, args, kwargs))
        except Exception as e:
            raise ValueError(f"collective_rpc: {method!r:.80} and its arguments must be picklable to reach the "
                             f"tensor-parallel workers ({type(e).__name__}: {e}); pass a method name or a "
                             f"module-level function.") from None
        self.rpc_count += 1
        self.send(("rpc", (self.rpc_count, call)))
        return self.rpc_count

    def finish_rpc(self, number: int, deadline: float | None) -> list:
        """The workers' results of call `number`, by rank. A worker's exception is raised here once
        every worker has answered; TimeoutError if one has not answered by `deadline`
        (time.monotonic())."""
        results, error = [], None
        for rank, conn in enumerate(self.conns, 1):
            while True:
                left_s = None if deadline is None else deadline - time.monotonic()
                if not conn.poll(0.1 if left_s is None else min(0.1, max(0.0, left_s))):
                    self.check_alive()
                    if left_s is not None and left_s <= 0:
                        raise TimeoutError(f"collective_rpc: tensor-parallel worker rank {rank} did not answer "
                                           f"in time.")
                    continue
                try:
                    answer, ok, value = conn.recv()
                except (EOFError, OSError):
                    self.check_alive(grace_s=5.0)
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} is gone; the engine is closed.") from None
                if answer == number:    # (an earlier call's late answer is dropped)
                    break
            results.append(value)
            if not ok and error is None:
                error = value
        if error is not None:
            raise error
        return results

    def any_dead(self) -> bool:
        return self.dead.is_set() or any(proc.exitcode is not None for proc in self.procs)

    def close(self):
        if self.closed:
            return
        died = self.any_dead()
        self.closed = True
        if self.watchdog is not None:
            try:
                self._wake_watchdog.send(None)
            except OSError:   # it has already returned (a worker died)
                pass
            self.watchdog.join()
            self._wake_watchdog.close()
        for conn in self.conns:
            try:
                conn.send(("exit", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if self.group is not None:
            if died and not self.aborted:   # free rank 0's GPU from collectives waiting for the dead
                self.group.abort()
                self.aborted = True
            self.group.close()


def worker_main(config, eos_token_ids, rank: int, port: int, conn):
    """Entry point of ranks 1..N-1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle; it closes us
    from nanovllm.engine.model_runner import ModelRunner, runner_device
    from nanovllm.utils.heap import freeze_heap, unfreeze_heap
    group = distributed.connect(port, rank, config.tensor_parallel_size, runner_device(config, rank),
                                not config.disable_custom_all_reduce)
    runner = ModelRunner(config, eos_token_ids, tp=group)
    freeze_heap()
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError):   # rank 0 is gone
            break
        if command == "exit":
            break
        if command == "step":
            runner.run_worker_step(payload)
        elif command == "rpc":
            _answer_rpc(conn, runner, *payload)
    unfreeze_heap()   # (so that the exit collects what start-up held: Triton's bindings report what it cannot)


def _answer_rpc(conn, runner, number: int, call: bytes):
    """Run a collective_rpc call and send (number, ok, result or exception) back to rank 0."""
    try:
        answer = (number, True, run_method(runner, *pickle.loads(call)))
    except Exception as e:
        answer = (number, False, e)
    try:
        conn.send(answer)
    except Exception as e:          # a result or exception that does not pickle
        conn.send((number, False, RuntimeError(f"collective_rpc: the answer of tensor-parallel worker rank "
                                               f"{runner.tp.rank} could not be sent: {type(e).__name__}: {e}")))
