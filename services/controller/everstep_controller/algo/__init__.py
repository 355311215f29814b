"""The algorithm (layer 5): the C3PO++ and sync schedulers, the training batch, the advantage estimators by name."""
