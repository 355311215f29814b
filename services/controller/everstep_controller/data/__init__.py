"""A job's data: datasets, prompts and their rendering, chat templates, reward items and reward errors (layer 3)."""
