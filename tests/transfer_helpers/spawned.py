"""One sender and N receiver processes (spawned: each sets up CUDA on its own), as the multi-process
GPU transfer tests run them. Targets put ``(who, result)`` on ``result_q``, a string on failure."""

import multiprocessing as mp


def run_sender_and_receivers(sender, receiver, n_receivers: int, *, sender_args=(), extra=(),
                             timeout_s: float = 180) -> dict:
    """``sender(*sender_args, endpoint_q, result_q, *extra)`` and, for ranks 1..n,
    ``receiver(rank, endpoint_q, result_q, *extra)``; results by who, failing the test naming every error."""
    ctx = mp.get_context("spawn")
    endpoint_q, result_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=sender, args=(*sender_args, endpoint_q, result_q, *extra))]
    procs += [ctx.Process(target=receiver, args=(rank, endpoint_q, result_q, *extra))
              for rank in range(1, 1 + n_receivers)]
    for p in procs:
        p.start()
    try:
        results = dict(result_q.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = {who: r for who, r in results.items() if isinstance(r, str)}
    assert not errors, errors
    return results
