"""everstep sandbox service."""
