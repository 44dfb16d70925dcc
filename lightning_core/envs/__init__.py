"""Environment services: a heavy environment runs once, as an HTTP service, and serves the
sessions of many rollouts on other machines (docs/environments.md)."""
