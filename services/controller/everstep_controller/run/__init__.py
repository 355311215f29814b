"""Running jobs: manager, runners and the phases of a step, the clients to the services (layer 7)."""
