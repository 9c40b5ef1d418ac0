"""Reads a model `hpctrial checkpoint export` wrote (a LibTorch archive, through
torch.jit.load) and the state_dict the Python reader writes (`hpctrial_checkpoint.py CKPT
--out`, through torch.load), checks that both hold the same tensors, and prints each tensor's
name and the CRC-32C of its bytes, one per line, for the C++ test to compare with the model's.

    python3 exported_model.py SCRIPTS_DIR CKPT.h5 ARCHIVE STATE_DICT.pt
"""
import subprocess
import sys

import torch

scripts, checkpoint, archive, state_path = sys.argv[1:5]
sys.path.insert(0, scripts)
from hpctrial_checkpoint import crc32c  # noqa: E402

subprocess.run([sys.executable, f"{scripts}/hpctrial_checkpoint.py", checkpoint, "--out", state_path], check=True,
               stdout=subprocess.DEVNULL)
from_archive = torch.jit.load(archive).state_dict()
from_reader = torch.load(state_path)
if sorted(from_archive) != sorted(from_reader):
    sys.exit(f"the archive holds {sorted(from_archive)}, the state_dict {sorted(from_reader)}")
for name in sorted(from_archive):
    if not torch.equal(from_archive[name], from_reader[name]):
        sys.exit(f"{name} differs between the archive and the state_dict")
    print(name, crc32c(from_archive[name].contiguous().numpy().tobytes()))
