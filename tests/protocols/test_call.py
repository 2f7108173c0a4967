"""``Call.xs`` and ``Call.commit_many``: the compensations and residual updates of several
tensors at once give the same bits as ``Call.x`` and ``Call.commit`` tensor by tensor."""

import pytest
import torch

from gradzip.feedback import ErrorFeedback
from gradzip.protocols.base import Call


def _call(tensors, memory, frozen=()):
    names = [f"t{j}" for j in range(len(tensors))]
    call = Call(
        comm=None, names=names, tensors=tensors, contexts=[None] * len(tensors), memory=memory, out_dtype=torch.float32
    )
    call.frozen = set(frozen)
    return call


def _grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(5, 3, generator=g).to(torch.bfloat16),
        torch.randn(7, generator=g, dtype=torch.float64),
        torch.randn((), generator=g),
        torch.randn(4, 2, 2, generator=g),
        torch.randn(3, generator=g),
    ]


@pytest.mark.parametrize("frozen", [(), ("t4",)])
def test_xs_and_commit_many_match_x_and_commit(frozen):
    """Two steps over tensors of three dtypes (bfloat16 compensated in float32, float64 in
    float64), one without a residual at the first step and one frozen (not compensated: its
    gradient as it is, no residual kept): the same compensated inputs and residuals, bit for
    bit, as one tensor at a time, and the memory's spares reused alike."""
    mems = [ErrorFeedback(), ErrorFeedback()]
    for step in range(3):
        grads = _grads(step)
        one, many = _call(grads, mems[0], frozen), _call(grads, mems[1], frozen)
        idx = list(range(len(grads)))
        xs_one = [one.x(i).clone() for i in idx]
        xs_many = [x.clone() for x in many.xs(idx)]
        for a, b in zip(xs_one, xs_many):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert many.xs(idx)[0] is many.x(0)  # kept, as x() keeps it
        sents = [(x * 0.5).to(x.dtype) for x in xs_one]
        for i in idx:
            one.commit(i, sents[i])
        many.commit_many(idx, [s.reshape(-1) for s in sents])  # any shape of the element count
        assert mems[0].residuals.keys() == mems[1].residuals.keys() == {f"t{i}" for i in idx} - set(frozen)
        for n, r in mems[0].residuals.items():
            assert torch.equal(r, mems[1].residuals[n])
        assert mems[0]._spare.keys() == mems[1]._spare.keys()
        mems[0].release()
        mems[1].release()


def test_xs_refuses_a_tensor_compensated_after_its_residual_was_set():
    mem = ErrorFeedback()
    grads = _grads(0)
    call = _call(grads, mem)
    call.commit(0, call.x(0))
    with pytest.raises(RuntimeError, match="compensated after its residual was set"):
        call.xs([0, 1])
