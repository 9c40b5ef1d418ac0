"""The torchrun side of benchmarks/startup: the same MLP, data and global batch as the hpctrial
side, wrapped in DistributedDataParallel over gloo, started by torchrun (which sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT). Rank 0 prints the wall-clock time, in nanoseconds,
right after its first optimizer step; then every rank takes a second step and ends."""
import argparse
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    dataset = TensorDataset(torch.randn(8192, 32), torch.randint(0, 10, (8192,)))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(dataset, batch_size=64 // world, sampler=sampler, drop_last=True)
    model = nn.parallel.DistributedDataParallel(Mlp(32, 64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step, (data, target) in enumerate(loader):
        optimizer.zero_grad()
        F.nll_loss(model(data), target).backward()
        optimizer.step()
        if step == 0 and rank == 0:
            print(f"first step ended at {time.time_ns()}", flush=True)
        if step == 1:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
