"""``vmemkv info``: what this machine offers -- device, vmem drivers, attention backends."""
from __future__ import annotations

import argparse
import json
import platform


def collect() -> dict:
    """Device, drivers (with granularity or the reason they cannot run) and attention backends."""
    import torch

    from vmemkv import vmem
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "default_driver": None,
        "drivers": {},
        "attention_backends": {},
    }
    for name, reason in vmem.available_drivers().items():
        entry = {"available": reason is None, "reason": reason}
        if reason is None:
            driver = vmem.open_driver(name)
            entry["granularity_bytes"] = driver.granularity_bytes
            entry["device"] = driver.device
            driver.close()
        info["drivers"][name] = entry
    info["default_driver"] = "cuda" if info["drivers"]["cuda"]["available"] else "host"
    info["attention_backends"] = _backend_status()
    return info


def _backend_status() -> dict:
    from vmemkv.runtime.attention import describe_backends
    return {row.pop("name"): row for row in describe_backends()}


def register(subparsers) -> None:
    parser = subparsers.add_parser("info", help="print the device, vmem drivers and attention backends",
                                   description="Print what this machine offers: the device, the "
                                               "vmem drivers (with their page granularity, or why "
                                               "they cannot run) and the attention backends.")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")


def run(args: argparse.Namespace) -> int:
    """Print ``collect()``; a reader gone (``vmemkv info | head -1``) ends it quietly, status 0,
    as generate's and sweep's output does (``write_stdout``), not as a BrokenPipeError."""
    from vmemkv.scheduler.cliargs import write_stdout
    info = collect()
    write_stdout(json.dumps(info, indent=2) + "\n" if args.json else _text(info))
    return 0


def _text(info: dict) -> str:
    lines = [f"device          {info['device']}   (torch {info['torch']}, python {info['python']})",
             f"default driver  {info['default_driver']}"]
    for name, entry in info["drivers"].items():
        if entry["available"]:
            lines.append(f"driver {name:<8} available  granularity {entry['granularity_bytes']} "
                         f"bytes  tensors on {entry['device']}")
        else:
            lines.append(f"driver {name:<8} unavailable: {entry['reason']}")
    for name, entry in info["attention_backends"].items():
        state = "importable" if entry["available"] else f"unavailable: {entry['reason']}"
        lines.append(f"attention {name:<12} {state}  devices={','.join(entry['devices'])} "
                     f"kinds={','.join(entry['kinds'])}")
    return "".join(line + "\n" for line in lines)
