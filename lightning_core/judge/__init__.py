"""Judge rewards: a judge model scores or ranks a group's trajectories against a rubric
(docs/judge.md)."""
