#!/usr/bin/python3
"""Read an hpctrial checkpoint (docs/checkpoint-format.md) with h5py, without hpctrial.

    python3 hpctrial_checkpoint.py CKPT.h5                 # attributes and datasets
    python3 hpctrial_checkpoint.py CKPT.h5 --out model.pt  # model 0 as a PyTorch state_dict

From Python:
    from hpctrial_checkpoint import read_manifest, model_state_dict
    state = model_state_dict("ckpt-400.h5", model=0)
    net.load_state_dict(state)

Needs h5py and numpy (and torch for state dicts): Debian's python3-h5py and python3-torch.
The manifest's CRC-32C is checked; --verify checks every dataset's CRC too (slow in Python).
"""
import argparse
import json
import sys

import h5py
import numpy as np

FORMAT = "hpctrial-checkpoint"
FORMAT_VERSION = 1


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in bytes(data):
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _text(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def read_manifest(path):
    """The manifest (a dict), after checking the format and the manifest's checksum."""
    with h5py.File(path, "r") as f:
        if _text(f.attrs.get("format", b"")) != FORMAT:
            raise ValueError(f"{path}: not an hpctrial checkpoint")
        version = int(f.attrs["format_version"])
        if version > FORMAT_VERSION:
            raise ValueError(f"{path}: checkpoint format {version} is newer than this reader ({FORMAT_VERSION})")
        raw = f["manifest"][()].tobytes()
        if crc32c(raw) != int(f.attrs["manifest_crc32c"]):
            raise ValueError(f"{path}: the manifest is corrupt")
    return json.loads(raw)


def read_dataset(f, entry, verify=False):
    """A dataset as a numpy array of its dtype (bfloat16 comes back as float32)."""
    data = f[entry["name"]][()]
    array = np.asarray(data)
    if verify and entry["dtype"] != "bfloat16":
        if crc32c(array.tobytes()) != entry["crc32c"]:
            raise ValueError(f"dataset {entry['name']} is corrupt")
    if entry["dtype"] == "bool":
        array = array.astype(bool)
    return array.reshape(entry["shape"])


def model_state_dict(path, model=0, verify=False):
    """The parameters and buffers of wrapped model `model`, as a PyTorch state_dict."""
    import torch

    manifest = read_manifest(path)
    prefix = f"model/{model}/"
    state = {}
    with h5py.File(path, "r") as f:
        for entry in manifest["datasets"]:
            if not entry["name"].startswith(prefix):
                continue
            tensor = torch.from_numpy(np.ascontiguousarray(read_dataset(f, entry, verify)))
            if entry["dtype"] == "bfloat16":
                tensor = tensor.to(torch.bfloat16)
            state[entry["name"][len(prefix):]] = tensor
    if not state:
        raise ValueError(f"{path}: no model {model} in the checkpoint")
    return state


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--model", type=int, default=0)
    parser.add_argument("--out", help="write model MODEL's state_dict here with torch.save")
    parser.add_argument("--verify", action="store_true", help="check every dataset's CRC-32C")
    args = parser.parse_args()
    manifest = read_manifest(args.checkpoint)
    if args.out:
        import torch

        torch.save(model_state_dict(args.checkpoint, args.model, args.verify), args.out)
        print(f"wrote {args.out}")
        return 0
    for key, value in sorted(manifest.get("attributes", {}).items()):
        print(f"{key}: {value}")
    with h5py.File(args.checkpoint, "r") as f:
        for entry in manifest["datasets"]:
            if args.verify:
                read_dataset(f, entry, verify=True)
            print(f"{entry['name']:48} {entry['dtype']:9} {str(entry['shape']):20} {entry['nbytes']:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
