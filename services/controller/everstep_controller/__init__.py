"""everstep controller service."""
