"""Loads the mlp example's checkpoint into the same network defined in PyTorch and prints its
outputs for the input the C++ test uses, one value per line."""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, sys.argv[1])  # scripts/
from hpctrial_checkpoint import model_state_dict  # noqa: E402


class Mlp(torch.nn.Module):
    def __init__(self, features, hidden, classes):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.out(x), dim=1)


net = Mlp(32, 64, 10)
net.load_state_dict(model_state_dict(sys.argv[2], model=0, verify=True))
x = torch.linspace(-1, 1, 4 * 32).reshape(4, 32)
with torch.no_grad():
    for value in net(x).flatten().tolist():
        print(repr(value))
