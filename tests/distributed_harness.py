"""Run a function on several CPU processes joined by gloo, the way the distributed tests need it.

``run_distributed_test(fn, world_size, *args)`` starts ``world_size`` processes, initializes a gloo process group
in each, calls ``fn(*args)`` and re-raises the first failure in the caller with the rank and traceback (the other
ranks are stopped two seconds after a failure, rather than left waiting in a collective until the timeout). ``fn``
must be importable by the children, i.e. a module-level function. One launch should still check several things.

The ranks come from a fork server (multiprocessing's "forkserver"), never from a fork of the test process: the
server is a fresh interpreter started once per test process, which imports torch, Lightning, transformers and the
package on one thread (``tests/rank_preload.py``) and never runs a test; each rank is a fork of that clean server.
A rank thus sees none of the test process's threads, locks or state, as with "spawn", without paying the seconds
of imports each spawned interpreter costs.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

# Every wait of the tests on another process ends on that process's exit, a file or a queue; this deadline only
# stops a true hang. It is far above any run's duration on a loaded 2-core machine (the slowest launch takes about
# two minutes there), so a slow machine never turns a test red.
HANG_GUARD_S = 1800

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests.rank_preload"])  # read when the server starts, at the first launch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, errors, call: bytes, env: dict[str, str],
            init_process_group: bool) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0")
    import torch.distributed as dist

    if init_process_group:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn, args = pickle.loads(call)
        fn(*args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # skip interpreter teardown: gloo's threads can abort it ("terminate called without an active
    # exception") after every check has passed, which would read as a crash of this rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed_test(fn, world_size: int, *args, env: dict[str, str] | None = None, timeout: float = HANG_GUARD_S,
                         init_process_group: bool = True) -> None:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; raise the first error any rank hits here.

    The ranks see the usual launcher variables (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``), so a Lightning ``Trainer(devices=world_size)`` inside ``fn`` joins them as externally
    launched processes; pass ``init_process_group=False`` to let it create the process group itself.
    """
    errors = _CONTEXT.SimpleQueue()
    port = _free_port()
    # by value: multiprocessing would hand each tensor's storage over as a file descriptor, and a fork server
    # takes at most a few hundred of them per process
    call = pickle.dumps((fn, args))
    base_env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        _CONTEXT.Process(target=_worker, args=(rank, world_size, port, errors, call, base_env, init_process_group), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    failures = []
    deadline = time.monotonic() + timeout
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        while not errors.empty():  # read while the writer lives: a long traceback does not fit the pipe
            failures.append(errors.get())
            # the other ranks may wait in a collective the failed rank never reaches: give them a moment to
            # report their own errors, then stop them instead of waiting for the timeout
            deadline = min(deadline, time.monotonic() + 2.0)
        time.sleep(0.05)
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        # the first to arrive is the cause; later ones are often other ranks losing their peer
        rank, trace = failures[0]
        others = sorted({r for r, _ in failures[1:]} - {rank})
        also = f" (then ranks {others})" if others else ""
        raise AssertionError(f"rank {rank} of {world_size} failed first{also}:\n{trace}")
    if hung:
        raise AssertionError(f"ranks {hung} of {world_size} did not finish within {timeout} s (a hang?)")
    bad = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited abnormally (rank, exit code): {bad}")
