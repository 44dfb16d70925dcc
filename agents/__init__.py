"""Example agents written with the frameworks users already use; they know nothing of training."""
