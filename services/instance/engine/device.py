"""Which device the torch engine runs on (`--device`): the host CPU, or one CUDA GPU."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` as a torch device with its index (`cuda` is `cuda:0`); ValueError,
    naming the flag, for anything else or for a GPU this process cannot see."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch {torch.__version__} sees no CUDA device (a CPU-only build, or no "
                         "driver); use --device cpu")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)
