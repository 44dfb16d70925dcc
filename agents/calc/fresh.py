"""`python -m lightning_rl.agents.calc.fresh --fresh N --seed S`: new calc tasks as JSON lines.

A module of its own: run as `-m`, data.py (which the package imports) would be loaded twice.
"""

from lightning_rl.agents.calc.data import main

if __name__ == "__main__":
    main()
