"""Parallel composition: several protocols run as one, round by round.

:func:`parallel` runs several protocols (a ``Policy``'s or ``Adaptive``'s routes) as one:
merged round ``t`` holds round ``t - start[j]`` of every running protocol, works concatenated
in protocol order, and is ``last`` only when every protocol in it is on its last round.
:func:`aligned_starts` right-aligns the protocols whose round count is fixed, so that a plain
allreduce rides in the asynchronous last round. A route whose tensors sit back to back in the
call's ``dest`` (a layer's weight and bias in DDP's bucket) writes its result there
(:func:`contiguous_run`); the other routes write into a scratch buffer kept per call, and
:func:`scatter_routes` copies their tensors into the call's output."""

from __future__ import annotations

from collections.abc import Generator, Sequence

from ..comm import Round

__all__ = ["parallel", "aligned_starts", "scatter_routes", "contiguous_run"]


def parallel(protocols: Sequence[Generator], start: Sequence[int] | None = None) -> Generator[Round, None, list]:
    """Run several protocols as one; returns the list of their results.

    Merged round ``t`` holds round ``t - start[j]`` of every protocol ``j`` that has
    started and not finished, their works concatenated in protocol order. It is
    ``last`` only when every protocol in it is on its last round and none is
    still waiting to start. After a non-last merged round (its works done: the
    communicator waits on them), every protocol in it is resumed in order; one
    that returns gives its result, and one that had yielded its last round must
    return then. The final merged round's completion resumes the rest (decode
    only: they must not communicate, as :mod:`gradzip.comm` requires).

    ``start[j]`` (default 0) delays protocol ``j`` to merged round ``start[j]``; it
    is neither compressed nor launched before. If every running protocol finishes
    before a delayed one starts, the delayed one starts at once.
    Every rank must pass the same protocols and starts; then the collectives go
    out in the same order everywhere.
    """
    gens = list(protocols)
    k = len(gens)
    if start is None:
        start = [0] * k
    start = list(start)
    if len(start) != k or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in start):
        raise ValueError(f"start must be {k} integers in [0, inf), got {start!r}")
    results: list = [None] * k
    state = ["pending"] * k  # pending -> running -> done
    rounds: list[Round | None] = [None] * k
    t = 0
    try:
        while True:
            merged = []
            for j in range(k):
                if state[j] == "running":
                    was_last = rounds[j].last
                    try:
                        r = next(gens[j])
                    except StopIteration as stop:
                        results[j], state[j] = stop.value, "done"
                        continue
                    if was_last:
                        raise RuntimeError(f"protocol {j} yielded after its last round")
                    rounds[j] = r
                    merged.append(j)
                elif state[j] == "pending" and start[j] <= t:
                    try:
                        r = next(gens[j])
                    except StopIteration as stop:
                        results[j], state[j] = stop.value, "done"
                        continue
                    rounds[j], state[j] = r, "running"
                    merged.append(j)
            waiting = [j for j in range(k) if state[j] == "pending"]
            if not merged:
                if not waiting:
                    return results
                t = min(start[j] for j in waiting)
                continue
            last = not waiting and all(rounds[j].last for j in merged)
            yield Round([w for j in merged for w in rounds[j].works], last=last)
            t += 1
    finally:
        for j, g in enumerate(gens):
            if state[j] != "done":
                g.close()


def aligned_starts(protocols) -> list[int]:
    """Start rounds that make protocols whose round count is known (``Protocol.rounds``)
    end in the same round as the longest of them; the others start at once. A plain
    allreduce then rides in the asynchronous last round instead of a round that the
    next call must wait for."""
    counts = [p.rounds for p in protocols]
    longest = max((c for c in counts if c is not None), default=0)
    return [longest - c if c is not None else 0 for c in counts]


def scatter_routes(call, order, groups, subs, results):
    """One call's output from its routes' results: route ``order[k]`` carried the tensors
    ``groups[order[k]]`` (indices into ``call``) as the sub-call ``subs[k]`` and returned
    ``results[k]``; each tensor's slice of ``results[k]`` lands at its place in ``call``'s output
    (Policy's and Adaptive's routes, run side by side by :func:`parallel`). A slice a route
    already wrote at its place (its sub-call's ``dest`` was that range of the call's) is not
    copied again."""
    with call.codec():
        out = call.output()
        for key, sub, got in zip(order, subs, results):
            for j, i in enumerate(groups[key]):
                src, dst = got[sub.slice(j)], out[call.slice(i)]
                if src.numel() and src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype:
                    continue
                dst.copy_(src)
    return out


def contiguous_run(call, idx: list) -> slice | None:
    """The range of ``call``'s flat result that the tensors ``idx`` fill, in that order and
    back to back (a route's tensors that sit together in a DDP bucket), or None."""
    if not idx or any(b != a + 1 for a, b in zip(idx, idx[1:])):
        return None
    return slice(call.offsets[idx[0]], call.offsets[idx[-1] + 1])
