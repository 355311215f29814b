"""What lives in Redis: jobs, their progress, streams, and the client (layer 4)."""
