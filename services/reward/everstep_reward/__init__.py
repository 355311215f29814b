"""everstep reward service."""
