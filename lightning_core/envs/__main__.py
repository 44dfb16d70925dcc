"""Serve an environment as a service: `python -m lightning_core.envs --env module:Factory`.

The factory (a class or function, called with no arguments) makes one environment per
session. The key, if any, comes from LIGHTNING_ENV_API_KEY (never from the command line,
which other users of the machine can read); a service on anything but loopback needs one.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import uvicorn

from lightning_core.envs.config import EnvServiceConfig
from lightning_core.envs.server import create_env_app

KEY_VARIABLE = "LIGHTNING_ENV_API_KEY"


def load_factory(ref: str):
    module, _, name = ref.partition(":")
    if not module or not name:
        raise SystemExit(f"--env must be 'module:Factory', got {ref!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"cannot load {ref}: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, help="module:Factory of the environment")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    for name, field in EnvServiceConfig.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(field.default),
                            default=field.default, help=field.description)  # fmt: skip
    args = parser.parse_args(argv)
    key = os.environ.get(KEY_VARIABLE) or None
    if key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"serving on {args.host} needs a key: set {KEY_VARIABLE}")
    config = EnvServiceConfig(**{n: getattr(args, n) for n in EnvServiceConfig.model_fields})
    app = create_env_app(load_factory(args.env), config, api_key=key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
