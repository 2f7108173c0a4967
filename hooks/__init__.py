"""gradzip.hooks: front ends that plug gradzip into torch's DDP.

``register_hook(ddp, method)`` registers gradzip's communication hook; ``comm_hook(ddp, method)``
returns the ``(state, hook)`` pair of torch's ``ddp.register_comm_hook(state, hook)``.
Trainers: :mod:`gradzip.hooks.lightning` (PyTorch Lightning) and :mod:`gradzip.hooks.accelerate`
(Hugging Face Accelerate), imported on their own (they import their framework).
"""

from .ddp import HookState, comm_hook, gradzip_hook, register_hook

__all__ = ["register_hook", "comm_hook", "gradzip_hook", "HookState"]
