"""Held-out statistics: a policy's score with its uncertainty, and base-against-final comparison."""
