"""What keeps a run's servers and records safe: the keys servers ask for, secrets kept out of
logs, and adapter folders named from outside checked before they load."""
