"""C3PO++ against the synchronous baseline (`python -m benchmarks.c3po`): the flags and the comparison in `cli`,
the simulated engine at the paper's scale in `sim`, the real run in `real`."""
