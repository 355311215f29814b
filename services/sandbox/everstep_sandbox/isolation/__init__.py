"""How the sandbox isolates a run: everything between a request's program and the host.

- `namespaces`: probes what this host allows and builds the bubblewrap command that starts a slot
  (namespaces, the read-only root, private tmpfs mounts, dropped capabilities).
- `seccomp`: the syscall filter every run is under.
- `cgroups`: per-slot memory, process-count and CPU limits.
- `paths`: where a request's files may land inside a run's own file system.
- `slots`: the long-lived isolated zygotes that runs are forked from, reset between requests.

Every run gets (where this host allows) no network, a private writable /work and /tmp with
everything else read-only, a private PID namespace, a per-slot unprivileged uid, a seccomp filter,
cgroup limits on memory, processes and CPU, rlimits on CPU time and file size, a wall-clock timeout
and capped output, and every process it started is killed before the response is sent.

It does not protect against kernel exploits (the kernel is shared), CPU side channels, or reading
world-readable files under /usr and /etc. Where bubblewrap cannot create namespaces the slot runs as
a plain process and a warning says what is lost (docs/sandbox.md).
"""
