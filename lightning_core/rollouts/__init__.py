"""Rollouts: the runner that runs agents on the store's queue, how a command line names an
agent, and which tasks an iteration samples (curriculum, dynamic sampling)."""
