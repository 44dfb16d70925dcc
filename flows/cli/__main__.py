"""`python -m lightning_rl.flows.cli`: the `lightning-rl` command."""

from lightning_rl.flows.cli import main

main()
