"""The disk tier's folder and options: the folder a server takes (one flock each, so servers sharing a root never
write into each other's files), the size option, and the engine's tier from its config."""
from __future__ import annotations

import fcntl
import os

MAX_FOLDERS = 64            # servers that may share one root (each takes a folder of its own)


def open_disk_tier(config, source, model_config, name: str):
    """The engine's disk tier (config.kv_disk_dir), keyed by its fingerprint; None where it is off."""
    if config.kv_disk_dir is None:
        return None
    if model_config.linear_layers and not config.checkpoints():
        raise ValueError(f"kv_disk_dir: {name} is a hybrid linear-attention model ({model_config.architecture}) "
                         f"served with state_checkpoints 0: its prefixes are restored from saved states, and there "
                         f"are none to write; give it state checkpoints or serve it without kv_disk_dir")
    from ..fingerprint import system_fingerprint
    from .disk_tier import DiskTier
    return DiskTier(config.kv_disk_dir, parse_size(config.kv_disk_size),
                    system_fingerprint(config, source.weight_files))


def take_folder(base: str) -> tuple[str, int]:
    """The first folder s<N> under base that no live server holds, with its lock held for this process's life."""
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_disk_dir: cannot make the disk tier's folder {base}: {e}") from None
    for n in range(MAX_FOLDERS):
        folder = os.path.join(base, f"s{n}")
        fd = os.open(folder + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        os.makedirs(folder, exist_ok=True)
        return folder, fd
    raise RuntimeError(f"kv_disk_dir: {MAX_FOLDERS} servers already hold folders under {base}")


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def parse_size(text: str) -> int:
    """'20GiB', '500MB', '1.5G', '4096' (bytes) -> bytes."""
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"kv_disk_size must be a size such as 20GiB, 500MB or 1073741824, got {text!r}")
    return int(value * units[unit])
