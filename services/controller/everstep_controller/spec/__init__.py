"""The job spec: what a user submits, its documentation, and what it is checked against (layer 2)."""
