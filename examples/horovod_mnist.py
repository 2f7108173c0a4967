"""Horovod's PyTorch MNIST example, run by ``horovod.torch`` or by ``gradzip.horovod``.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_mnist.py                     # horovod.torch
    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_mnist.py --hvd gradzip
    torchrun --nproc_per_node=2 examples/horovod_mnist.py --hvd gradzip --compression 'TopK(0.01)'
    GRADZIP_COMPRESSION='TopK(0.01)' torchrun --nproc_per_node=2 examples/horovod_mnist.py --hvd gradzip

This is Horovod 0.28.1's ``examples/pytorch/pytorch_mnist.py`` (same network, optimizer,
sampler, broadcasts, ``DistributedOptimizer`` call and metric averaging), with two changes:
``--hvd`` picks the module imported as ``hvd`` (the only line a port changes), and the data
are the 5,000 real MNIST digits that gradzip's bench reads offline
(``gradzip.bench.load_dataset("mnist")``: 4,000 train, 1,000 test), not a torchvision
download. ``--compression`` is ``none``/``fp16`` (``hvd.Compression``) or, with ``--hvd
gradzip``, any gradzip method (``'TopK(0.01)'``, ``'PowerSGD(rank=2)'``). ``--out FILE`` writes
the test accuracy, a hash of the final parameters, the bytes counted (gradzip) and the run's
settings as JSON (rank 0); ``--save-params FILE`` saves the final parameters (rank 0).
The last command above leaves the script's ``Compression.none`` as it is and picks the method
from the environment (``docs/horovod.md``): rank 0 reports the method and, at exit, its ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="PyTorch MNIST Example (Horovod's, on gradzip.horovod or horovod.torch)")
    p.add_argument(
        "--hvd",
        choices=["horovod", "gradzip"],
        default="horovod",
        help="import horovod.torch or gradzip.horovod as hvd",
    )
    p.add_argument("--batch-size", type=int, default=64, metavar="N", help="input batch size for training")
    p.add_argument("--test-batch-size", type=int, default=1000, metavar="N", help="input batch size for testing")
    p.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
    p.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate")
    p.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
    p.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
    p.add_argument(
        "--log-interval",
        type=int,
        default=0,
        metavar="N",
        help="batches between logging training status (0: per epoch only)",
    )
    p.add_argument(
        "--compression", default="none", help="none, fp16 (hvd.Compression), or a gradzip method with --hvd gradzip"
    )
    p.add_argument(
        "--gradient-predivide-factor",
        type=float,
        default=1.0,
        help="apply gradient predivide factor in optimizer (default: 1.0)",
    )
    p.add_argument("--train-size", type=int, default=0, help="use the first N training digits (0: all 4,000)")
    p.add_argument("--out", default="", help="write the results as JSON here (rank 0)")
    p.add_argument("--save-params", default="", help="torch.save the final parameters here (rank 0)")
    return p


def params_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.hvd == "gradzip":
        import gradzip.horovod as hvd
    else:
        import horovod.torch as hvd

    from gradzip.bench import load_dataset

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)
    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    xtr, ytr, xte, yte = load_dataset("mnist", seed=args.seed)
    if args.train_size:
        xtr, ytr = xtr[: args.train_size], ytr[: args.train_size]
    train_dataset = torch.utils.data.TensorDataset(xtr, ytr)
    test_dataset = torch.utils.data.TensorDataset(xte, yte)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    # Horovod: scale learning rate by the number of GPUs.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    if args.compression in ("none", "fp16"):
        compression = getattr(hvd.Compression, args.compression)
    elif args.hvd == "gradzip":
        compression = args.compression  # a gradzip method, read by gradzip.parse
    else:
        raise SystemExit(f"--compression {args.compression!r} needs --hvd gradzip")

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    def train(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if args.log_interval and batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}")

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.0
        test_accuracy = 0.0
        for data, target in test_loader:
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()
        # Horovod: use test_sampler to determine the number of examples in this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%")
        return test_loss, test_accuracy

    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        loss, acc = test()
    result = {
        "hvd": args.hvd,
        "compression": args.compression,
        "seed": args.seed,
        "epochs": args.epochs,
        "size": hvd.size(),
        "test_loss": loss,
        "test_accuracy": float(acc),
        "params_sha256": params_hash(model),
        "seconds": time.perf_counter() - t0,
    }
    if args.hvd == "gradzip":
        result["stats"] = optimizer.stats()
    if hvd.rank() == 0:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        if args.save_params:
            torch.save(model.state_dict(), args.save_params)
    return result


if __name__ == "__main__":
    main()
