#!/usr/bin/python3
"""Read an hpctrial checkpoint (docs/checkpoint-format.md) with h5py, without hpctrial.

    python3 hpctrial_checkpoint.py CKPT.h5                 # attributes and datasets
    python3 hpctrial_checkpoint.py CKPT.h5 --out model.pt  # model 0 as a PyTorch state_dict
                                                           # (a pipeline's stages joined)

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


def model_parts(path):
    """(parts, pipeline): how the checkpoint's model lies over ranks (meta/model_parallel)."""
    with h5py.File(path, "r") as f:
        if "meta/model_parallel" not in f:
            return 1, False
        record = json.loads(np.asarray(f["meta/model_parallel"][()]).tobytes().decode())
    return int(record["parts"]), bool(record.get("pipeline", False))


def model_state_dict(path, model=0, verify=False, part=None):
    """The parameters and buffers of wrapped model `model`, as a PyTorch state_dict.

    A pipeline's stages are joined into the whole model (its layers are named by their index
    in it); a model the trial split over ranks itself is taken one part at a time (`part`).
    """
    import torch

    manifest = read_manifest(path)
    parts, pipeline = model_parts(path)
    if parts == 1:
        if part not in (None, 0):
            raise ValueError(f"{path} holds its model whole, not in parts: leave out the part")
        prefixes = [f"model/{model}/"]
    elif part is not None:
        if not 0 <= part < parts:
            raise ValueError(f"{path} holds a model in {parts} parts, 0 to {parts - 1}; part {part} is none of them")
        prefixes = [f"model_parallel/{part}/model/{model}/"]
    elif pipeline:
        prefixes = [f"model_parallel/{k}/model/{model}/" for k in range(parts)]
    else:
        raise ValueError(f"{path} holds a model the trial split into {parts} parts (model parallelism), which "
                         f"only the trial's code joins: take one part at a time (--part 0 to {parts - 1})")
    entries = {entry["name"]: entry for entry in manifest["datasets"]}
    state = {}
    with h5py.File(path, "r") as f:
        for prefix in prefixes:
            for name, entry in sorted(entries.items()):
                if not name.startswith(prefix) or name[len(prefix):] in state:
                    continue
                tensor = torch.from_numpy(np.ascontiguousarray(read_dataset(f, entry, verify)))
                if entry["dtype"] == "bfloat16":
                    tensor = tensor.to(torch.bfloat16)
                state[name[len(prefix):]] = tensor
    if not state:
        raise ValueError(f"{path}: no model {model} in the checkpoint")
    return dict(sorted(state.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--model", type=int, default=0)
    parser.add_argument("--part", type=int, help="the part of a model the trial split over ranks")
    parser.add_argument("--out", help="write model MODEL's state_dict here with torch.save")
    parser.add_argument("--verify", action="store_true", help="check every dataset's CRC-32C")
    args = parser.parse_args()
    manifest = read_manifest(args.checkpoint)
    if args.out:
        import torch

        try:
            state = model_state_dict(args.checkpoint, args.model, args.verify, args.part)
        except ValueError as e:
            print(f"hpctrial_checkpoint.py: {e}", file=sys.stderr)
            return 2
        torch.save(state, args.out)
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
