"""everstep trainer service."""
