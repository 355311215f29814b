"""Stand-in for a machine without libseccomp: first on PYTHONPATH, it shadows the real `pyseccomp`, and importing
it fails as the real one does where it finds no libseccomp.so (tests/sandbox/test_seccomp.py)."""

raise ImportError("stand-in: libseccomp is not installed on this (simulated) machine")
