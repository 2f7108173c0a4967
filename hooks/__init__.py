"""gradzip.hooks: front ends that plug gradzip into torch's DDP."""

from .ddp import HookState, register_hook

__all__ = ["register_hook", "HookState"]
