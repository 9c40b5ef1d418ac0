"""The PyTorch DDP side of benchmarks/ddp_compare: the same MLP, data sizes, optimizer and global
batch as the hpctrial side, trained with torch.nn.parallel.DistributedDataParallel over gloo.
ddp_compare starts it; it starts its ranks with torch.multiprocessing.spawn (PyTorch's own
launcher; torch.distributed.run of Debian's 1.13 fails under Python 3.11); rank 0 prints
"samples/s: X"."""
import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Mlp(nn.Module):
    def __init__(self, features, hidden, classes):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.out(x), dim=1)


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--features", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--classes", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    return parser.parse_args()


def train(rank, args, port):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nproc)
    world = dist.get_world_size()
    torch.manual_seed(1)
    x = torch.randn(args.samples, args.features)
    y = torch.randint(0, args.classes, (args.samples,))
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)
    model = nn.parallel.DistributedDataParallel(Mlp(args.features, args.hidden, args.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    step, epoch, start = 0, 0, None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for data, target in loader:
            if step == args.warmup:
                start = time.perf_counter()
            if step == args.steps - 1:
                elapsed = time.perf_counter() - start
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        samples = (args.steps - 1 - args.warmup) * (args.global_batch // world) * world
        print(f"samples/s: {samples / elapsed:.1f}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    arguments = parse()
    torch.multiprocessing.spawn(train, args=(arguments, free_port()), nprocs=arguments.nproc)
