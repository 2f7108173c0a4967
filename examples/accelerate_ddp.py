"""Hugging Face Accelerate with gradzip: an Accelerator-prepared model trained with any method.

    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --method "TopK(0.01)" --save-at 100
    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --resume OUT/step100 --steps 200   # carry on
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py --method "PowerSGD(rank=2)" --accum 2

(On CPUs ``accelerate launch --cpu`` starts one process, or several through MPI: torchrun starts
the gloo ranks. The GPU line has not run in gradzip's tests.)

``compress(accelerator, model, method)`` (``gradzip.hooks.accelerate``) registers gradzip's hook
on the model ``accelerator.prepare`` wrapped; ``accelerator.accumulate`` skips it on its no_sync
steps, ``accelerator.save_state`` writes every rank's gradzip state beside Accelerate's own
files (``--save-at``) and ``load_state`` restores it (``--resume``: bit for bit), and every
``--log-every`` steps gradzip's per-step scalars go to the Accelerator's trackers: a CSV file
under ``--out`` here (a custom tracker, Accelerate's ``GeneralTracker``). The task is synthetic
(a random teacher network labels Gaussian inputs), so nothing is downloaded. Needs
``pip install 'gradzip[accelerate]'``.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="TopK(0.01)", help="a gradzip method spec")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (accelerator.accumulate)")
    ap.add_argument("--batch", type=int, default=32, help="per rank and micro-batch")
    ap.add_argument("--log-every", type=int, default=10, help="steps between logged rows")
    ap.add_argument(
        "--momentum-correction", action="store_true", help="gradzip takes the SGD momentum over (DGC's correction)"
    )
    ap.add_argument("--save-at", type=int, default=None, help="accelerator.save_state after this step (OUT/stepN)")
    ap.add_argument("--resume", default=None, help="a save_state folder to carry on from")
    ap.add_argument("--out", default=None, help="checkpoints and metrics.csv here (default: a new temporary folder)")
    return ap


def csv_tracker():
    """An Accelerate tracker that writes every ``log`` call to the CSV file ``path`` (set before
    the first log) on the main process."""
    import csv

    from accelerate.tracking import GeneralTracker, on_main_process

    class CSVTracker(GeneralTracker):
        name = "csv"
        requires_logging_directory = False

        def __init__(self) -> None:  # not @on_main_process: that would set up Accelerate's state before the Accelerator
            super().__init__()
            self.path, self.rows = None, []

        @property
        def tracker(self):
            return self.rows

        @on_main_process
        def store_init_configuration(self, values: dict) -> None:
            pass

        @on_main_process
        def log(self, values: dict, step: int | None = None, **kwargs) -> None:
            self.rows.append({"step": step, **values})
            keys = list(dict.fromkeys(k for row in self.rows for k in row))
            with open(self.path, "w", newline="") as f:
                w = csv.DictWriter(f, keys)
                w.writeheader()
                w.writerows(self.rows)

    return CSVTracker()


def main(argv=None) -> dict:
    a = parser().parse_args(argv)  # --help and a bad flag answer before torch and Accelerate load
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list
    from ddp_torchrun import make_data

    import gradzip as gz
    from gradzip.hooks.accelerate import compress

    method = gz.parse(a.method)  # a bad method is refused here, before any training
    tracker = csv_tracker()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(), gradient_accumulation_steps=a.accum, log_with=[tracker]
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    where = [a.out or (tempfile.mkdtemp(prefix="gradzip_accelerate_") if accelerator.is_main_process else None)]
    out = broadcast_object_list(where)[0]  # one folder for every rank (save_state writes from each)
    os.makedirs(out, exist_ok=True)
    tracker.path = os.path.join(out, "metrics.csv")
    accelerator.init_trackers("gradzip")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = compress(
        accelerator, model, method, optimizer=optimizer if a.momentum_correction else None, log_every=a.log_every
    )
    start = 0
    if a.resume:
        accelerator.load_state(a.resume)  # model, optimizer, RNG, step counter and gradzip's state
        start = state.step  # gradzip counts optimizer steps (the hook runs once a step)

    x, y = make_data(8192)
    x, y = x[rank::world].to(accelerator.device), y[rank::world].to(accelerator.device)
    saved = None
    for step in range(start, a.steps):
        for micro in range(a.accum):
            g = torch.Generator().manual_seed(1000 * (step * a.accum + micro) + rank)  # the same batches on resume
            b = torch.randint(len(x), (a.batch,), generator=g).to(accelerator.device)
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x[b]), y[b])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        if a.save_at is not None and step + 1 == a.save_at:
            saved = os.path.join(out, f"step{step + 1}")
            accelerator.save_state(saved)
    for tracker in accelerator.trackers:  # accelerator.end_training(), less its destroy_process_group (below)
        tracker.finish()
    s = state.stats()
    if accelerator.is_main_process:
        print(f"{a.method}: final loss {loss.item():.4f}, {s['steps']} steps, link ratio {s['ratio']:.1f}x; in {out}")
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "stats": s,
        "momentum_buffers": len(state.state_dict()["momentum"]),
        "routes": state.routes(),
        "saved": sorted(os.listdir(saved)) if saved else [],
        "dir": out,
        "metrics": os.path.join(out, "metrics.csv"),
    }


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
