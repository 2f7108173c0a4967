"""PyTorch Lightning with gradzip: a LightningModule trained under Trainer(strategy="ddp").

    python examples/lightning_ddp.py --method "TopK(0.01)"                 # Lightning starts 2 CPU ranks
    torchrun --nproc_per_node 2 examples/lightning_ddp.py --method "PowerSGD(rank=2)"
    python examples/lightning_ddp.py --resume OUT/checkpoints/epoch=1-step=64.ckpt   # carry on

``GradzipCallback(method)`` (``gradzip.hooks.lightning``) registers gradzip's hook on the model
Lightning wraps in DistributedDataParallel; every epoch's checkpoint carries every rank's gradzip
state (``--resume`` carries on bit for bit), and gradzip's per-step scalars
(``gradzip/link_ratio``, ``gradzip/link_bytes_per_step``, ...) go to the Trainer's loggers: a CSV
under ``--out`` here. The task is synthetic (a random teacher network labels Gaussian inputs), so
nothing is downloaded. Needs ``pip install 'gradzip[lightning]'``.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="TopK(0.01)", help="a gradzip method spec")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4096, help="training samples, shared out over the ranks")
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--devices", type=int, default=2, help="CPU ranks (torchrun: its --nproc_per_node)")
    ap.add_argument("--log-every", type=int, default=10, help="steps between logged rows")
    ap.add_argument(
        "--momentum-correction", action="store_true", help="gradzip takes the SGD momentum over (DGC's correction)"
    )
    ap.add_argument("--out", default=None, help="checkpoints and metrics.csv here (default: a new temporary folder)")
    ap.add_argument("--resume", default=None, help="a checkpoint of an earlier run to carry on from")
    return ap


def make_module(lr: float):
    """A small MLP classifier as a LightningModule (SGD with momentum)."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)  # every rank starts alike (DDP would broadcast rank 0's weights anyway)
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    return Classifier()


def main(argv=None) -> dict:
    a = parser().parse_args(argv)  # --help and a bad flag answer before torch and Lightning load
    import warnings

    import lightning as L
    import torch
    from ddp_torchrun import make_data
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from gradzip.hooks.lightning import GradzipCallback

    # a bad method is refused here, before any rank starts
    gz_callback = GradzipCallback(a.method, momentum_correction=a.momentum_correction)
    out = a.out or os.environ.get("GRADZIP_LIGHTNING_OUT")
    if out is None and int(os.environ.get("RANK", "0")) == 0:  # Lightning's launcher hands its ranks this env
        out = os.environ["GRADZIP_LIGHTNING_OUT"] = tempfile.mkdtemp(prefix="gradzip_lightning_")
    elif out is None:  # torchrun's other ranks: they write nothing (checkpoints go to rank 0's folder)
        out = tempfile.gettempdir()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # a tiny in-memory dataset

    x, y = make_data(a.samples)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=a.batch, shuffle=True)
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(out, "checkpoints"), filename="{epoch}-{step}", every_n_epochs=1, save_top_k=-1
    )
    csv = CSVLogger(out, name="csv")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=a.devices,
        strategy="ddp",
        max_epochs=a.epochs,
        callbacks=[gz_callback, checkpoints],
        logger=csv,
        log_every_n_steps=a.log_every,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = make_module(lr=0.05)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=a.resume)
    s = gz_callback.state.stats()
    if trainer.is_global_zero:
        print(
            f"{a.method}: {s['steps']} steps, link ratio {s['ratio']:.1f}x; checkpoints in {checkpoints.dirpath}, "
            f"gradzip's scalars in {os.path.join(csv.log_dir, 'metrics.csv')}"
        )
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "stats": s,
        "momentum_buffers": len(gz_callback.state.state_dict()["momentum"]),
        "routes": gz_callback.state.routes(),
        "checkpoints": sorted(os.listdir(checkpoints.dirpath)) if os.path.isdir(checkpoints.dirpath) else [],
        "dir": out,
        "metrics": os.path.join(csv.log_dir, "metrics.csv"),
    }


if __name__ == "__main__":
    main()
