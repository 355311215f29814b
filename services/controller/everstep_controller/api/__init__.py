"""The REST API: the app and its request limits (layer 8)."""
